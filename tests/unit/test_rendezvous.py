"""The elastic launcher's rendezvous (comm/rendezvous.py), served on its real Unix socket, with
workers' requests made by the real client from threads: who forms each generation, in which order,
and what is refused."""

import json
import os
import socket
import threading

import pytest

from fastxfer.comm import rendezvous
from fastxfer.comm.rendezvous import Rendezvous
from fastxfer.errors import FastxferError, PeerFailureError

SECRET = "s" * 64


@pytest.fixture
def rdzv(tmp_path, monkeypatch):
    r = Rendezvous(SECRET, str(tmp_path), min_np=2, max_np=3, timeout=0.5)
    r.serve()
    monkeypatch.setenv(rendezvous.SOCKET_ENV, r.path)
    monkeypatch.setenv("FASTXFER_JOB_SECRET", SECRET)
    monkeypatch.setenv(rendezvous.WORKER_ENV, "0")  # request() changes both: restored after the test
    yield r
    r.close("test over")


def request(op, worker, secret=SECRET):
    """The worker client's request, as worker `worker` (through the environment, as a worker has it)."""
    os.environ[rendezvous.WORKER_ENV] = str(worker)
    os.environ["FASTXFER_JOB_SECRET"] = secret
    return rendezvous._request(op, 30)


def join_all(workers):
    """Every worker joins from its own thread; {worker: reply or exception}."""
    out = {}
    path = os.environ[rendezvous.SOCKET_ENV]

    def one(w):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            sock.sendall(json.dumps({"op": "join", "worker": str(w), "secret": SECRET}).encode() + b"\n")
            out[w] = json.loads(rendezvous._read_line(sock))

    threads = [threading.Thread(target=one, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    return threads, out


def first_generation(rdzv, order, late=0.0):
    """Workers 0, 1, 2 started and joined in `order` (after `late` seconds: the first generation
    has no timeout, however long workers take to start): generation 0's replies, by worker."""
    for w in "012":
        rdzv.started(w)
    rdzv.expect_first(["0", "1", "2"])
    threading.Event().wait(late)
    assert rdzv.overdue() == []
    threads, out = join_all(order)
    for t in threads:
        t.join(10)
    return out


def test_generations_form_from_who_is_expected_in_rank_order(rdzv):
    out = first_generation(rdzv, [2, 0, 1])
    assert {w: (r["generation"], r["rank"], r["size"]) for w, r in out.items()} == {
        0: (0, 0, 3), 1: (0, 1, 3), 2: (0, 2, 3)}
    # worker 0 (rank 0) dies: the survivors form generation 1 in their old order
    rdzv.exited("0", failed=True)
    assert rdzv.expected == ["1", "2"]
    threads, out = join_all([2, 1])
    for t in threads:
        t.join(10)
    assert {w: (r["generation"], r["rank"], r["size"]) for w, r in out.items()} == {1: (1, 0, 2), 2: (1, 1, 2)}
    assert request("poll", 1) == {"generation": 1, "pending": False}
    # a restarted worker asks to join: pending until the members re-form at a commit
    rdzv.started("3")
    newcomer, got = join_all([3])
    for _ in range(100):
        if request("poll", 1)["pending"]:
            break
        threading.Event().wait(0.05)
    assert request("poll", 1) == {"generation": 1, "pending": True}
    threads, out = join_all([1, 2])
    for t in threads + newcomer:
        t.join(10)
    assert {w: r["rank"] for w, r in {**out, **got}.items()} == {1: 0, 2: 1, 3: 2}
    assert {r["generation"] for r in {**out, **got}.values()} == {2}
    assert request("poll", 1) == {"generation": 2, "pending": False}  # max_np 3 reached


def test_a_member_that_does_not_come_back_is_overdue(rdzv):
    first_generation(rdzv, [0, 1, 2], late=0.7)  # past the 0.5 s timeout: not overdue
    rdzv.exited("2", failed=True)
    threads, out = join_all([0])
    threading.Event().wait(0.7)
    assert rdzv.overdue() == ["1"]  # stalled: the launcher kills it
    rdzv.exited("1", failed=True)
    for t in threads:
        t.join(10)
    assert (out[0]["generation"], out[0]["size"]) == (1, 1)


def test_requests_without_the_secret_or_from_strangers_are_refused(rdzv):
    rdzv.started("0")
    with pytest.raises(FastxferError, match="request refused: not from a worker of this job"):
        request("poll", 0, secret="x" * 64)
    with pytest.raises(FastxferError, match="worker 7 is not one of this job's running workers"):
        request("join", 7)
    assert oct(os.stat(rdzv.path).st_mode & 0o777) == "0o600"
    rdzv.close("the job has ended")
    with pytest.raises(PeerFailureError, match="cannot reach the elastic launcher"):
        request("poll", 0)


def _send_raw(path, data, read=True):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        try:
            sock.sendall(data)
            return rendezvous._read_line(sock) if read else None
        except ConnectionResetError:  # the launcher dropped us mid-message: what it does to junk
            return b""


def test_garbage_on_the_socket_is_dropped_quietly_and_the_launcher_keeps_serving(rdzv):
    """Issue 34 row 11: a non-ASCII secret raised TypeError in hmac.compare_digest, deeply nested JSON
    RecursionError, both as tracebacks in the launcher's threads; 120 idle connections filled the
    backlog so that a worker reported "the launcher has stopped". Now each is refused or dropped
    without an exception escaping, and a worker's request still gets its answer."""
    escaped = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    try:
        path = rdzv.path
        reply = json.loads(_send_raw(path, json.dumps({"op": "poll", "worker": "0", "secret": "sécret"}).encode()
                                     + b"\n"))
        assert reply == {"error": "request refused: not from a worker of this job"}
        assert json.loads(_send_raw(path, json.dumps({"op": "poll", "worker": "0", "secret": 7}).encode() + b"\n")) \
            == {"error": "request refused: not from a worker of this job"}
        for junk in (b"[" * 60000 + b"\n", b"{\"a\": " * 10000 + b"\n", b"\xff\xfe\n", b"[1, 2]\n", b"\n",
                     b"x" * 70000):
            assert _send_raw(path, junk) == b""  # closed without an answer
        idle = []
        for _ in range(120):  # connections that never say anything
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            idle.append(s)
        try:
            assert request("poll", 0) == {"generation": -1, "pending": False}
        finally:
            for s in idle:
                s.close()
        assert rendezvous.parse_message(b"[" * 5 + b"]" * 5) is None
        assert rendezvous.parse_message(b'{"op": "join"}') == {"op": "join"}
    finally:
        threading.excepthook = old_hook
    assert not escaped, escaped
