"""Elastic rendezvous: how the workers of `fastxfer run --min-np M` agree on each generation of
the group (who is in it, in which rank order) with the launcher as the only coordinator.

The launcher (launch/elastic.py) owns a :class:`Rendezvous` and serves it on a Unix socket inside its
private report folder (mode 0700: only the job's user can reach it; every request also carries the
job secret, which only the workers' environment holds). A worker talks to it in two ways:

- ``join`` (from init()): "put me in the next generation". The reply -- generation number, rank,
  size -- comes when the generation is formed: every worker the launcher expects in it has asked.
  The generation number picks the shared-memory segment's name, so every member derives the same
  name without another round.
- ``poll`` (from ``state.commit()`` on rank 0): "is a change waiting?" -- a restarted or added
  worker that asked to join; the members then re-form at the same commit (elastic.py).

Who is expected in a generation (the launcher decides, from what it sees of its children):

- the first: the N workers it started;
- after a member failed: the members still alive, in their old rank order (a worker that stalls
  instead of dying is killed when it does not come within the rendezvous timeout); newcomers
  (restarted workers) only when fewer than ``min_np`` members are left;
- after a member's ``join`` without a failure (the members saw a pending newcomer at a commit):
  the members alive plus the newcomers waiting, up to ``max_np``.

The protocol is one JSON object per line each way, one request per connection.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import selectors
import socket
import threading
import time

from fastxfer import settings
from fastxfer.errors import FastxferError, PeerFailureError

SOCKET_ENV = "FASTXFER_ELASTIC_SOCKET"
WORKER_ENV = "FASTXFER_WORKER_ID"
_MAX_LINE = 1 << 16


_MAX_NESTING = 4  # brackets a message of the rendezvous may hold: a flat object of plain values
_MAX_PENDING = 1024  # connections that have not sent their request yet; more are turned away
_READ_TIMEOUT = 5.0  # seconds a connection may take to send its request (a worker sends it at once)


def parse_message(data: bytes) -> dict | None:
    """A rendezvous message: a JSON object of strings, numbers and booleans on one line, else None.
    Bounded: the brackets are counted before parsing, so deeply nested input is refused without
    recursing, and no exception of any kind escapes (another local process may send anything)."""
    if len(data) > _MAX_LINE or data.count(b"[") + data.count(b"{") > _MAX_NESTING:
        return None
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or not all(isinstance(k, str) for k in msg):
        return None
    return msg


def same_secret(given, secret: str) -> bool:
    """Whether `given` (anything a peer sent) is the job's secret, in constant time; never raises
    (hmac.compare_digest refuses non-ASCII str, so both are compared as UTF-8 bytes)."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), secret.encode("utf-8", "surrogatepass"))


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ("R", "S", "T" stopped, ...), "" when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _read_line(sock: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > _MAX_LINE:
            raise ValueError("rendezvous message too long")
    return bytes(buf)


# -- worker side ------------------------------------------------------------------------------------
def is_elastic() -> bool:
    """Whether this process was started by an elastic launcher (`fastxfer run --min-np`)."""
    return settings.is_set(SOCKET_ENV)


_progress_at: list[float] = []  # this worker's last commit (time.monotonic(): one clock for the host)


def note_progress() -> None:
    """The state was committed now (fastxfer.elastic): the launcher times a recovery from the
    members' last progress."""
    _progress_at[:] = [time.monotonic()]


def _request(op: str, timeout: float | None) -> dict:
    path = settings.get(SOCKET_ENV)
    worker = settings.get(WORKER_ENV)
    secret = settings.get("FASTXFER_JOB_SECRET")
    if not path or worker is None or not secret:
        raise FastxferError(f"{SOCKET_ENV}, {WORKER_ENV} and FASTXFER_JOB_SECRET must all be set (by "
                            "`fastxfer run --min-np`)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        try:
            _connect(s, path, timeout)
            msg = {"op": op, "worker": str(worker), "secret": secret}
            if op == "join" and _progress_at:
                msg["progress_at"] = _progress_at[0]
            s.sendall(json.dumps(msg).encode() + b"\n")
            line = _read_line(s)
        except socket.timeout:
            raise PeerFailureError(f"the elastic launcher did not answer '{op}' within {timeout:g} s") from None
        except OSError as e:
            raise PeerFailureError(f"cannot reach the elastic launcher at {path} ({e.strerror or e}): it has "
                                   "stopped") from None
    finally:
        s.close()
    if not line:
        raise PeerFailureError("the elastic launcher closed the connection without an answer: it has stopped")
    reply = parse_message(line)
    if reply is None:
        raise PeerFailureError(f"the elastic launcher at {path} sent something that is not its answer")
    if "error" in reply:
        raise FastxferError(f"elastic launcher: {reply['error']}")
    return reply


def _connect(s: socket.socket, path: str, timeout: float | None) -> None:
    """Connect, retrying while the launcher's queue of connections is full (EAGAIN: other local
    processes may hold it for a moment), until `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            s.connect(path)
            return
        except (BlockingIOError, InterruptedError):
            if deadline is not None and time.monotonic() + delay > deadline:
                raise socket.timeout from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def join() -> dict:
    """Blocks until the launcher forms a generation with this worker in it; returns
    ``{"generation", "rank", "size"}``."""
    return _request("join", None)


def poll() -> dict:
    """``{"generation", "pending"}``: the current generation and whether a worker waits to join."""
    return _request("poll", 60.0)


# -- launcher side ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Generation:
    number: int
    members: list[str]  # worker ids in rank order
    formed_at: float
    began: float = 0.0  # when the group stopped: the members' last commit, or the forming began


class Rendezvous:
    """The launcher's view of the group: which workers are alive, who is in the current generation,
    who waits to join. Thread-safe; serve() answers the workers' requests on its own threads."""

    def __init__(self, secret: str, directory: str, min_np: int, max_np: int, timeout: float = 60.0,
                 start_timeout: float | None = None):
        self.secret = secret
        # how long the first generation waits for a started worker to reach init() (None: for ever)
        self.start_timeout = start_timeout
        self.started_at: dict[str, float] = {}
        self.path = os.path.join(directory, "rendezvous.sock")
        self.min_np, self.max_np, self.timeout = min_np, max_np, timeout
        self.cond = threading.Condition()
        self.current: Generation | None = None
        self.history: list[Generation] = []
        self.alive: list[str] = []          # started and not exited, in start order
        self.waiting: dict[str, float] = {}  # worker -> when it asked to join
        self.pids: dict[str, int] = {}  # worker -> its process id (the members learn each other's)
        self.last_progress: float | None = None  # the re-forming members' last commit
        self.expected: list[str] | None = None  # the next generation's members, while one is forming
        self.forming_since = 0.0
        self.closed: str | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    # the launcher's events
    def started(self, worker: str, pid: int = 0) -> None:
        with self.cond:
            self.alive.append(worker)
            self.pids[worker] = pid
            self.started_at[worker] = time.monotonic()

    def expect_first(self, workers: list[str]) -> None:
        with self.cond:
            self.expected = list(workers)
            self.forming_since = time.monotonic()

    def exited(self, worker: str, failed: bool) -> None:
        """A worker exited. A failed member starts the forming of a generation without it."""
        with self.cond:
            if worker in self.alive:
                self.alive.remove(worker)
            self.waiting.pop(worker, None)
            if self.expected is not None and worker in self.expected:
                self.expected.remove(worker)
            elif failed and self.current is not None and worker in self.current.members and self.expected is None:
                self._begin(after_failure=True)
            self._maybe_form()
            self.cond.notify_all()

    def close(self, why: str) -> None:
        with self.cond:
            self.closed = why
            self.cond.notify_all()
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def overdue(self) -> list[str]:
        """Expected members that have not asked to join within the timeout of a re-forming; for the
        first generation, workers that have not reached init() within start_timeout of their start."""
        now = time.monotonic()
        with self.cond:
            if self.expected is None:
                return []
            if self.current is None:
                if self.start_timeout is None:
                    return []
                return [w for w in self.expected if w not in self.waiting
                        and now - self.started_at.get(w, now) >= self.start_timeout]
            if now - self.forming_since < self.timeout:
                return []
            return [w for w in self.expected if w not in self.waiting]

    def stopped(self) -> list[str]:
        """Expected members that have not asked to join and whose process is stopped (SIGSTOP):
        they cannot join; the launcher need not wait out the timeout for them."""
        with self.cond:
            if self.expected is None:
                return []
            late = [w for w in self.expected if w not in self.waiting]
            pids = {w: self.pids.get(w, 0) for w in late}
        return [w for w, pid in pids.items() if pid and _process_state(pid) in ("T", "t")]

    def pending(self) -> list[str]:
        """Newcomers waiting to join (not members of the current generation)."""
        with self.cond:
            members = set(self.current.members) if self.current else set()
            return [w for w in self.waiting if w not in members and w in self.alive]

    def members(self) -> list[str]:
        with self.cond:
            return list(self.current.members) if self.current else []

    # forming
    def _begin(self, after_failure: bool) -> None:
        members = [w for w in self.current.members if w in self.alive] if self.current else []
        newcomers = [w for w in self.alive if w not in members]
        if after_failure:
            # survivors only, unless too few are left: then the restarted workers as well
            extra = newcomers if len(members) < self.min_np else []
        else:
            extra = [w for w in newcomers if w in self.waiting]
        self.expected = (members + extra)[:self.max_np]
        self.forming_since = time.monotonic()

    def _maybe_form(self) -> None:
        if self.expected is None or any(w not in self.waiting for w in self.expected):
            return
        if not self.expected:
            return  # nobody left to form a generation: the launcher ends the job
        number = self.current.number + 1 if self.current else 0
        began = self.forming_since if self.last_progress is None else min(self.forming_since, self.last_progress)
        gen = Generation(number, list(self.expected), time.monotonic(), began)
        self.last_progress = None
        self.current = gen
        self.history.append(gen)
        self.expected = None
        for w in gen.members:
            self.waiting.pop(w, None)
        self.cond.notify_all()

    def _join(self, worker: str, progress_at: float | None = None) -> dict:
        with self.cond:
            if worker not in self.alive:
                return {"error": f"worker {worker} is not one of this job's running workers"}
            self.waiting[worker] = time.monotonic()
            if progress_at is not None and self.current is not None and worker in self.current.members \
                    and progress_at <= self.waiting[worker]:
                # the group made progress until its members' last commit
                self.last_progress = max(self.last_progress or progress_at, progress_at)
            if self.expected is None and self.current is not None:
                if worker in self.current.members:
                    self._begin(after_failure=False)  # a member re-forms: after a failure or at a commit
                # else: a newcomer; the members see it at their next commit (poll) and re-form
            self._maybe_form()
            self.cond.notify_all()
            while True:
                if self.closed is not None:
                    return {"error": self.closed}
                if worker not in self.alive:
                    return {"error": f"worker {worker} was stopped by the launcher"}
                gen = self.current
                if gen is not None and worker in gen.members and worker not in self.waiting:
                    # the members' pids: a member that dies before it attaches is noticed at once
                    return {"generation": gen.number, "rank": gen.members.index(worker), "size": len(gen.members),
                            "pids": [self.pids.get(w, 0) for w in gen.members]}
                self.cond.wait(1.0)

    def _poll(self, worker: str) -> dict:
        with self.cond:  # a reentrant lock: pending() takes it again
            gen = self.current
            room = len(gen.members) < self.max_np if gen else False
            return {"generation": gen.number if gen else -1, "pending": bool(self.pending()) and room}

    # serving
    def serve(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        os.chmod(self.path, 0o600)
        s.listen(256)
        self._sock = s
        self._thread = threading.Thread(target=self._accept, name="fastxfer-rendezvous", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        """Reads requests from every connection at once, on this one thread, without blocking on
        any (a connection that sends nothing costs a buffer until its deadline, not a thread); a
        complete request line gets a thread of its own, as a join may wait for its generation."""
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        pending: dict[socket.socket, list] = {}  # connection -> [bytes so far, deadline]

        def drop(c):
            sel.unregister(c)
            del pending[c]
            c.close()

        try:
            while self.closed is None:
                try:
                    events = sel.select(0.5)
                except (OSError, ValueError):
                    return  # the socket was closed
                now = time.monotonic()
                for key, _ in events:
                    if key.data is None:  # a new connection
                        try:
                            conn, _ = self._sock.accept()
                        except OSError:
                            continue
                        if len(pending) >= _MAX_PENDING:  # a flood: the newest is turned away
                            conn.close()
                            continue
                        conn.setblocking(False)
                        pending[conn] = [b"", now + _READ_TIMEOUT]
                        sel.register(conn, selectors.EVENT_READ, conn)
                        continue
                    conn = key.data
                    try:
                        chunk = conn.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        drop(conn)
                        continue
                    buf = pending[conn][0] + chunk
                    if not chunk or len(buf) > _MAX_LINE:
                        drop(conn)
                        continue
                    if b"\n" not in buf:
                        pending[conn][0] = buf
                        continue
                    sel.unregister(conn)
                    del pending[conn]
                    req = parse_message(buf.split(b"\n", 1)[0])
                    if req is None:  # not a message of ours: dropped without an answer
                        conn.close()
                        continue
                    conn.setblocking(True)
                    threading.Thread(target=self._handle, args=(conn, req), daemon=True).start()
                for c in [c for c, (_, deadline) in pending.items() if deadline < now]:
                    drop(c)
        finally:
            for c in list(pending):
                c.close()
            sel.close()

    def _handle(self, conn: socket.socket, req: dict) -> None:
        try:
            conn.settimeout(None)
            if not same_secret(req.get("secret"), self.secret):
                reply = {"error": "request refused: not from a worker of this job"}
            elif req.get("op") == "join":
                at = req.get("progress_at")
                reply = self._join(str(req.get("worker")), at if isinstance(at, (int, float)) else None)
            elif req.get("op") == "poll":
                reply = self._poll(str(req.get("worker")))
            else:
                reply = {"error": f"unknown request {req.get('op')!r}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass
        finally:
            conn.close()
