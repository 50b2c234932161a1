"""The machinery every way of starting workers on this host shares: workers that die with the
launcher, the stop signals it turns into a clean stop, ``Job`` (worker processes with their output
prefixed) and ``Stopper`` (SIGTERM, then SIGKILL). local.py and elastic.py build their jobs on it."""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

from fastxfer.launch import output
from fastxfer.launch.output import say

# How the launcher stops: the signals it turns into a clean stop of the job, and why it says it got them.
STOP_SIGNALS = {
    signal.SIGINT: "interrupted (SIGINT)",
    signal.SIGTERM: "asked to stop (SIGTERM)",
    signal.SIGHUP: "lost its terminal (SIGHUP)",
}
KILL_AFTER_S = 5.0  # after the forwarded SIGTERM, SIGKILL for whoever is still running

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

# The CPU-binding helper workers start through with --bind, run by file, not `-m`: `-m` would put
# the working directory first on sys.path
BIND_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bind.py")


def die_with_parent(parent_pid: int):
    """A ``preexec_fn`` for workers: SIGKILL this child when the launcher dies, however it dies
    (SIGKILL, OOM killer, a crash), so no rank is ever left running as an orphan.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so workers must be
    started from the launcher's main thread (Job.start checks). It survives the exec of the
    worker (not of a set-uid program). If the launcher died between fork and prctl, the child has
    already been re-parented: it checks and leaves at once. Everything the function calls is
    resolved before the fork, and it only makes a system call and compares pids."""
    prctl, sigkill, getppid, kill, getpid = _prctl, int(signal.SIGKILL), os.getppid, os.kill, os.getpid

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0) != 0:
            raise OSError("prctl(PR_SET_PDEATHSIG) failed")  # Popen reports it; the worker never starts
        if getppid() != parent_pid:  # the launcher is already gone
            kill(getpid(), sigkill)

    return preexec


def horovod_place(rank: int, size: int) -> dict[str, str]:
    """The variables horovodrun gives a worker of a one-host job, for scripts that read them before init()."""
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(rank),
            "HOROVOD_LOCAL_SIZE": str(size), "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}


class Stopper:
    """How a launcher stops its workers: once told to (``stop_at``: when a failure's grace runs out)
    or sent a stop signal, SIGTERM to every worker, then SIGKILL after KILL_AFTER_S, at once after
    a second stop signal. ``tick()`` from the launcher's wait loop."""

    def __init__(self, job: "Job", noun: str):
        self.job, self.noun = job, noun
        self.stop_at: float | None = None
        self.term_at: float | None = None
        self.kill_at: float | None = None
        self.announced = False

    def tick(self, now: float, before_term=None) -> None:
        job = self.job
        if job.interrupted is not None and not self.announced:
            self.announced = True
            with job.lock:
                say(f"fastxfer run: the launcher {STOP_SIGNALS[job.interrupted]}: sending SIGTERM to every "
                    f"{self.noun}, SIGKILL after {KILL_AFTER_S:g} s")
            if self.term_at is None:
                self.stop_at = now
        if self.stop_at is not None and now >= self.stop_at and self.term_at is None:
            if before_term is not None:
                before_term()
            job.signal_all(signal.SIGTERM)
            self.term_at = now
            self.kill_at = now + KILL_AFTER_S
        if job.hurry and self.kill_at is not None:
            self.kill_at = min(self.kill_at, now)
        if self.kill_at is not None and now >= self.kill_at:
            job.signal_all(signal.SIGKILL)
            self.kill_at = now + 1.0


class Job:
    """Workers on this host, each a process of its own session that dies with the launcher, its
    output prefixed with its number; SIGINT/SIGTERM/SIGHUP to the launcher stop them cleanly.

    A mode subclasses it: ``worker_env`` (what a worker's environment says about the job) and
    ``wait`` (when the job ends and its exit code); ``run()`` starts the job and waits for it."""

    def __init__(self, np_: int, command: list[str], grace: float, extra_env: dict[str, str] | None = None,
                 placement: list[dict] | None = None, output_dir: str | None = None):
        self.np = np_
        self.output_dir = output_dir  # horovodrun's --output-filename: each rank's output also in DIR/rank.R/
        self.command = command
        self.placement = placement  # per-rank plan from fastxfer.topology, or None (no binding)
        self.grace = grace
        self.job_id = f"{os.getpid()}-{secrets.token_hex(16)}"  # names the job; not secret
        self.secret = secrets.token_hex(32)  # only in the ranks' environment: picks their segment names
        self.extra_env = extra_env or {}
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.interrupted: int | None = None  # the stop signal the launcher got, if any
        self.hurry = False
        self._old_handlers: dict | None = None
        self.exit_times: dict[int, float] = {}  # rank -> when it exited (a waiter thread per rank)
        # where a rank that gives up waiting names the rank that stalled (csrc/transport/shm/segment.cc)
        self.report_dir = output.make_report_dir()

    def run(self) -> int:
        """Starts the job and waits for it; returns its exit code."""
        self.catch_stop_signals()
        self.start()
        return self.wait()

    def base_env(self, slot: int) -> dict[str, str]:
        """The launcher's environment with placement `slot`'s thread settings under the user's own."""
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.placement is not None:
            for k, v in self.placement[slot]["env"].items():
                env.setdefault(k, v)  # the user's own settings win
        return env

    def worker_env(self, slot: int, worker: int) -> dict[str, str]:
        """Worker `worker`'s environment, in placement `slot`."""
        raise NotImplementedError

    def wait(self) -> int:
        """Waits for the job to end; returns its exit code."""
        raise NotImplementedError

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the forking *thread* exits: from another thread, the
            # workers would be killed when that thread ends, not when the launcher does
            raise RuntimeError("Job.start() must run on the main thread (workers die with the thread that "
                               "started them)")
        preexec = die_with_parent(os.getpid())
        for r in range(self.np):
            if self.interrupted is not None:
                break  # told to stop while starting: wait() stops the ranks already running
            self.spawn(r, preexec)

    def spawn(self, r: int, preexec, slot: int | None = None) -> subprocess.Popen:
        """Start worker `r` (on the main thread: see start()) in placement `slot` (default: r); its
        output is prefixed with [r]."""
        width = len(str(self.np - 1))
        cmd = self.command
        if self.placement is not None:
            w = self.placement[r if slot is None else slot]
            cmd = [sys.executable, BIND_SCRIPT, "--cpus", w["cpus"], "--mems", ",".join(map(str, w["mem_nodes"])),
                   "--"] + cmd
        env = self.worker_env(r if slot is None else slot, r)
        try:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
        except (OSError, subprocess.SubprocessError) as e:
            self.signal_all(signal.SIGKILL)
            shutil.rmtree(self.report_dir, ignore_errors=True)
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise SystemExit(f"fastxfer run: cannot start {self.command[0]!r}: {why}") from None
        self.procs.append(p)
        waiter = threading.Thread(target=self._wait_one, args=(r, p), daemon=True)
        waiter.start()
        prefix = f"[{r:>{width}}] ".encode()
        for stream, out, name in ((p.stdout, sys.stdout.buffer, "stdout"), (p.stderr, sys.stderr.buffer, "stderr")):
            copy = output.rank_file(self.output_dir, r, name) if self.output_dir else None
            t = threading.Thread(target=output.pump, args=(stream, out, prefix, self.lock, copy), daemon=True)
            t.start()
            self.pumps.append(t)
        return p

    def _wait_one(self, rank: int, p: subprocess.Popen) -> None:
        p.wait()
        with self.lock:
            self.exit_times[rank] = time.monotonic()

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _on_signal(self, signum, _frame) -> None:
        if self.interrupted is None:
            self.interrupted = signum
        else:
            self.hurry = True  # a second stop signal: SIGKILL now, no more grace

    def catch_stop_signals(self) -> None:
        """From here on, SIGINT/SIGTERM/SIGHUP stop the job cleanly instead of killing the launcher
        (call before start(): a signal while ranks are starting must not orphan the ones started)."""
        if self._old_handlers is None:
            self._old_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}

    def restore_signals(self) -> None:
        """The launcher's own handlers of the stop signals back, once the job is over."""
        for s, h in (self._old_handlers or {}).items():
            signal.signal(s, h)
        self._old_handlers = None
