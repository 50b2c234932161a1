"""The engine end to end: multi-process through `fastxfer run`, results checked exactly."""

import re

import ml_dtypes
import numpy as np
import pytest

import fastxfer as fx
from _launch import fastxfer_segments, launch

W = "collectives_worker.py"


def ok_lines(r, tag):
    return [ln for ln in r.stdout.splitlines() if f"OK {tag}" in ln]


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_every_dtype_op_and_size_exact(np_):
    # sizes 0, 1, odd, and larger than the staging window and the bucket cap
    r = launch(np_, W, "sweep")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(ok_lines(r, "sweep")) == np_


@pytest.mark.parametrize("np_", [2, 3])
def test_compressed_allreduce_matches_its_exact_contract(np_):
    r = launch(np_, W, "compressed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(ok_lines(r, "compressed")) == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_broadcast_allgather_async_inplace_oob(np_):
    r = launch(np_, W, "collectives")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(ok_lines(r, "collectives")) == np_


@pytest.mark.parametrize("kind", ["name", "shape", "dtype", "op", "order", "count", "compression", "oob"])
def test_mismatch_raises_on_every_rank(kind):
    r = launch(2, W, "mismatch", kind)
    out = r.stdout
    assert "NO ERROR" not in out
    assert out.count("] MISMATCH rank") == 2 and out.count("STILL-MISMATCH") == 2, out + r.stderr
    # both ranks report the same disagreement
    msgs = sorted(set(re.sub(r"^\[\d\] MISMATCH rank \d: ", "", ln) for ln in out.splitlines()
                      if " MISMATCH rank" in ln))
    assert len(msgs) == 1, msgs
    assert r.returncode == 3


@pytest.mark.parametrize("how,n,compression", [("kill", 1000, "none"), ("kill", 3_000_000, "none"),
                                               ("exit", 3_000_000, "bf16"), ("kill", 300_001, "fp16")])
def test_dead_peer_fails_the_others_fast(how, n, compression):
    before = fastxfer_segments()
    r = launch(3, W, "die", how, n, compression)
    survivors = re.findall(r"PEER-FAILURE rank (\d) after ([\d.]+)s: (.*)", r.stdout)
    assert sorted(s[0] for s in survivors) == ["0", "2"], r.stdout + r.stderr
    assert all(float(s[1]) < 10 for s in survivors)
    assert all("rank 1" in s[2] for s in survivors)
    # the launcher names the rank that failed first and exits with its code
    cause = "killed by SIGKILL" if how == "kill" else "exit code 17"
    assert f"rank 1 failed first ({cause})" in r.stderr
    assert r.returncode == (137 if how == "kill" else 17)
    assert fastxfer_segments() == before


def test_silent_peer_times_out():
    r = launch(2, W, "hang", env={"FASTXFER_TIMEOUT": "2"}, launcher_args=["--grace", "30"])
    m = re.search(r"TIMEOUT rank 0 after ([\d.]+)s: rank 1 did not answer within 2 s", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) < 10
    assert "rank 0 failed first (exit code 6)" in r.stderr


def test_shutdown_while_a_peer_still_reduces_is_a_mismatch_not_a_hang():
    r = launch(2, W, "shutdown_early")
    assert "SHUTDOWN-ERROR rank 0: MismatchError" in r.stdout, r.stdout + r.stderr
    assert "ERROR rank 1: MismatchError" in r.stdout
    assert r.returncode == 4


def test_segment_is_owner_only_and_gone_once_everyone_attached():
    import os
    import stat
    import subprocess
    import sys
    import time

    from _launch import WORKERS, fastxfer_cmd

    before = set(fastxfer_segments())
    p = subprocess.Popen(fastxfer_cmd() + ["run", "-np", "2", "--", sys.executable, f"{WORKERS}/{W}", "slow_attach"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    seen = None
    deadline = time.monotonic() + 30
    while seen is None and time.monotonic() < deadline and p.poll() is None:
        new = [n for n in fastxfer_segments() if n not in before]
        if new:
            seen = new[0]
            mode = stat.S_IMODE(os.stat(f"/dev/shm/{seen}").st_mode)
            # unguessable: the launcher's pid plus 128 random bits
            assert re.fullmatch(r"fastxfer-\d+-[0-9a-f]{32}", seen), seen
        time.sleep(0.02)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert seen is not None, "the segment was never visible while rank 1 was late"
    assert mode == 0o600
    assert set(fastxfer_segments()) == before


def test_layout_from_launcher():
    r = launch(3, W, "info")
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"[{k}] INFO rank={k} size=3 local_rank={k} local_size=3" in r.stdout


# ---- single process, in this interpreter ----------------------------------------------------

@pytest.fixture
def single():
    fx.init()
    yield
    fx.shutdown()


def test_calls_before_init_raise():
    assert not fx.is_initialized()
    for f in (fx.rank, fx.size, fx.local_rank, fx.local_size, fx.barrier):
        with pytest.raises(fx.FastxferError, match=r"call fastxfer.init\(\) first"):
            f()
    with pytest.raises(fx.FastxferError, match="init"):
        fx.allreduce(np.ones(3, np.float32))


def test_single_process_semantics(single):
    assert (fx.rank(), fx.size(), fx.local_rank(), fx.local_size()) == (0, 1, 0, 1)
    x = np.arange(10, dtype=np.float32) / 3
    np.testing.assert_array_equal(fx.allreduce(x), x)
    # compression rounds even on one rank: the result is what the wire carried
    np.testing.assert_array_equal(fx.allreduce(x, compression="bf16"),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(fx.allgather(np.ones((2, 2))), np.ones((2, 2)))
    assert fx.engine_stats()["chunks"] >= 2


def test_bad_arguments(single):
    with pytest.raises(TypeError, match="dtype complex64"):
        fx.allreduce(np.ones(3, np.complex64))
    with pytest.raises(ValueError, match="applies to float32 arrays; this one is float64"):
        fx.allreduce(np.ones(3), compression="bf16")
    with pytest.raises(ValueError, match="compression must be"):
        fx.allreduce(np.ones(3, np.float32), compression="zip")
    with pytest.raises(TypeError, match="op='average' needs a floating dtype"):
        fx.allreduce(np.ones(3, np.int32))
    with pytest.raises(ValueError, match="op must be one of"):
        fx.allreduce(np.ones(3), op="prod")
    with pytest.raises(ValueError, match=r"root must be a rank in 0..0"):
        fx.broadcast(np.ones(3), root=1)
    with pytest.raises(ValueError, match="at least one dimension"):
        fx.allgather(np.float32(1.0))
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        fx.allgather(np.ones((1,) * 9))
    with pytest.raises(ValueError, match=r"out must be float32\[3\]"):
        fx.allreduce(np.ones(3, np.float32), out=np.empty(4, np.float32))
    with pytest.raises(ValueError, match="oob_allreduce is for small arrays"):
        fx.oob_allreduce(np.ones(1 << 20))
    with pytest.raises(TypeError, match="name must be a str"):
        fx.allreduce(np.ones(3), name=3)
    # errors in arguments do not break the group
    np.testing.assert_array_equal(fx.allreduce(np.ones(3), op="sum"), np.ones(3))


def test_engine_thread_is_pinned_to_the_given_cpus():
    import os

    def read(path):
        with open(path) as f:
            return f.read()

    cpu = sorted(os.sched_getaffinity(0))[-1]
    fx.init(engine_cpus=[cpu])
    try:
        tasks = f"/proc/{os.getpid()}/task"
        engine = [t for t in os.listdir(tasks) if read(f"{tasks}/{t}/comm").strip() == "fastxfer-engine"]
        assert len(engine) == 1
        status = read(f"{tasks}/{engine[0]}/status")
        allowed = [ln.split(":")[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")]
        assert allowed == [str(cpu)]
        assert fx.allreduce(np.ones(3), op="sum").tolist() == [1.0] * 3
    finally:
        fx.shutdown()
    with pytest.raises(ValueError, match="not all in this process's CPU set"):
        fx.init(engine_cpus=[10_000])
    with pytest.raises(fx.FastxferError, match="bad CPU list"):
        fx.init(engine_cpus="0-x")


def test_init_twice_is_harmless_and_shutdown_then_reinit(single):
    fx.init()
    assert fx.size() == 1
    fx.shutdown()
    with pytest.raises(fx.FastxferError):
        fx.rank()
    fx.init()
    assert fx.allreduce(np.ones(2), op="sum").tolist() == [1.0, 1.0]
