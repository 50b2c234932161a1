"""``fastxfer run``: start N workers on this host (or hand off to mpirun for several hosts),
prefix their output with their rank, and stop the job when one of them fails.

When a worker fails, the others get a grace period (default 10 s) to notice through fastxfer
(they raise PeerFailureError within a second or so and exit); whoever is still running after it
is sent SIGTERM, then SIGKILL. The exit code is the first failed rank's (128 + signal number for
a signal), and the last line says which rank failed and how. Shared-memory segments of the job
are removed at the end, and segments of earlier jobs whose launcher is gone are swept at start.

Workers die with the launcher: each is started with PR_SET_PDEATHSIG = SIGKILL, so a launcher
that is killed (even with SIGKILL) leaves no rank running. SIGINT, SIGTERM and SIGHUP (the
terminal went away) stop the job cleanly instead: every rank gets SIGTERM, then SIGKILL after
5 s (a second signal: at once); the segments are removed, the exit code is 128 + the signal
number, and the last line says why the job stopped.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from fastxfer.comm import segments
from fastxfer.errors import FastxferError

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


REPORT_PREFIX = "fastxfer-report-"


def sweep_stale_report_dirs() -> list[str]:
    """Remove this user's stall-report folders whose launcher (pid in the name) is gone (a launcher
    killed with SIGKILL cannot remove its own)."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), REPORT_PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(REPORT_PREFIX):].split("-", 1)[0])
            if os.lstat(path).st_uid != os.getuid() or segments.pid_alive(pid):
                continue
            shutil.rmtree(path)
            removed.append(path)
        except (ValueError, OSError):
            continue
    return removed


def sweep_stale_segments() -> list[str]:
    """Remove this user's fastxfer segments whose creating launcher (pid in the name) is gone."""
    return segments.sweep_stale()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    broken = False
    for line in iter(stream.readline, b""):
        if broken:
            continue  # keep draining, so a worker never blocks on a full pipe
        with lock:
            try:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()
            except OSError:  # the terminal went away (EIO after SIGHUP) or the reader closed the pipe
                broken = True
    stream.close()


def say(line: str) -> None:
    """The launcher's own messages on stderr; a stderr that went away (SIGHUP, closed pipe) is not an error."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


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
    def __init__(self, np_: int, command: list[str], grace: float, extra_env: dict[str, str] | None = None,
                 placement: list[dict] | None = None):
        self.np = np_
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
        self.report_dir = tempfile.mkdtemp(prefix=f"{REPORT_PREFIX}{os.getpid()}-")

    def _base_env(self, slot: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.placement is not None:
            for k, v in self.placement[slot]["env"].items():
                env.setdefault(k, v)  # the user's own settings win
        return env

    def _env(self, rank: int, worker: int | None = None) -> dict[str, str]:
        env = self._base_env(rank)
        env.update({
            "FASTXFER_RANK": str(rank),
            "FASTXFER_SIZE": str(self.np),
            "FASTXFER_LOCAL_RANK": str(rank),
            "FASTXFER_LOCAL_SIZE": str(self.np),
            "FASTXFER_JOB_ID": self.job_id,
            "FASTXFER_REPORT_DIR": self.report_dir,
            "FASTXFER_JOB_SECRET": self.secret,
            "PYTHONUNBUFFERED": "1",
        })
        return env

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
            # by file, not `-m`: `-m` would put the working directory first on sys.path
            bindexec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bindexec.py")
            cmd = [sys.executable, bindexec, "--cpus", w["cpus"], "--mems", ",".join(map(str, w["mem_nodes"])),
                   "--"] + cmd
        env = self._env(r if slot is None else slot, r)
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
        for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
            t = threading.Thread(target=_pump, args=(stream, out, prefix, self.lock), daemon=True)
            t.start()
            self.pumps.append(t)
        return p

    def _wait_one(self, rank: int, p: subprocess.Popen) -> None:
        p.wait()
        with self.lock:
            self.exit_times[rank] = time.monotonic()

    def _first_failure(self) -> tuple[int, int] | None:
        """The failed rank that exited earliest (its peers' PeerFailureErrors come after)."""
        with self.lock:
            failed = [(t, r) for r, t in self.exit_times.items() if self.procs[r].returncode not in (None, 0)]
        if not failed:
            return None
        _, r = min(failed)
        return r, self.procs[r].returncode

    def stall_reports(self) -> dict[int, tuple[int, str]]:
        """rank -> (the rank it names as stalled, its message), from the ranks' stall reports."""
        reports = {}
        for r in range(self.np):
            try:
                with open(os.path.join(self.report_dir, f"stall.{r}")) as f:
                    culprit, _, msg = f.read().partition("\n")
                reports[r] = (int(culprit), msg.strip())
            except (OSError, ValueError):
                continue
        return reports

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

    def _restore_signals(self) -> None:
        for s, h in (self._old_handlers or {}).items():
            signal.signal(s, h)
        self._old_handlers = None

    def wait(self) -> int:
        """Waits for every rank; stops the job when one fails or the launcher is told to stop
        (forward SIGTERM to every rank, SIGKILL after KILL_AFTER_S); removes the job's segments.
        Returns the exit code; the last line on stderr says why the job ended when it failed."""
        self.catch_stop_signals()
        stopper = Stopper(self, "rank")
        try:
            while len(self.exit_times) < len(self.procs):
                now = time.monotonic()
                if stopper.stop_at is None:
                    failure = self._first_failure()
                    if failure is not None:
                        r, code = failure
                        with self.lock:
                            say(f"fastxfer run: rank {r} failed ({describe_exit(code)}); "
                                f"giving the other ranks {self.grace:g} s to stop")
                        stopper.stop_at = now + self.grace
                stopper.tick(now)
                time.sleep(0.05)
            for t in self.pumps:
                t.join(timeout=5)
        finally:
            self._restore_signals()
            segments.remove_segments_of(os.getpid())
            reports = self.stall_reports()
            shutil.rmtree(self.report_dir, ignore_errors=True)
        first = self._first_failure()
        if self.interrupted is not None:
            states = ", ".join(f"rank {i}: {describe_exit(p.returncode)}" for i, p in enumerate(self.procs))
            say(f"fastxfer run: job stopped: the launcher {STOP_SIGNALS[self.interrupted]}; all ranks stopped "
                f"({states})")
            return 128 + self.interrupted
        if first is None:
            return 0
        r, code = first
        others = [f"rank {i}: {describe_exit(p.returncode)}" for i, p in enumerate(self.procs) if i != r]
        if r in reports and reports[r][0] != r:
            # the first to fail gave up waiting: blame the rank it waited for, not the messenger
            culprit, msg = reports[r]
            say(f"fastxfer run: job failed: rank {culprit} stalled (named by rank {r}: {msg}); rank {r} gave up "
                f"waiting for it ({describe_exit(code)})" + (f"; {', '.join(others)}" if others else ""))
        else:
            say(f"fastxfer run: job failed: rank {r} failed first ({describe_exit(code)})"
                 + (f"; {', '.join(others)}" if others else ""))
        return 128 - code if code < 0 else code


def parse_hosts(text: str) -> list[tuple[str, int]]:
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        try:
            n = int(slots) if slots else 1
        except ValueError:
            raise SystemExit(f"fastxfer run: bad --hosts entry {item!r}: expected host or host:slots") from None
        if n < 1 or not name:
            raise SystemExit(f"fastxfer run: bad --hosts entry {item!r}")
        hosts.append((name, n))
    if not hosts:
        raise SystemExit("fastxfer run: --hosts is empty")
    return hosts


def mpirun_command(np_: int, hosts: list[tuple[str, int]], command: list[str],
                   env: dict[str, str] | None = None) -> list[str]:
    """mpirun's command line; every FASTXFER_* setting of `env` (default: this process's) goes to
    the ranks on every host (`-x`), as they go to the ranks `fastxfer run` starts on one host."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise SystemExit("fastxfer run: --hosts hands the job to mpirun, which is not on PATH: install MPI "
                         "(pip install 'fastxfer[mpi]' brings Open MPI and mpi4py) and try again")
    if sum(n for _, n in hosts) < np_:
        raise SystemExit(f"fastxfer run: --hosts offers {sum(n for _, n in hosts)} slots for -np {np_}")
    host_arg = ",".join(f"{h}:{n}" for h, n in hosts)
    forward = [x for name in sorted(os.environ if env is None else env) if name.startswith("FASTXFER_")
               for x in ("-x", name)]
    return [mpirun, "-np", str(np_), "--host", host_arg, "-x", "PYTHONUNBUFFERED=1", *forward] + command


def mpi_environment(np_: int, hosts: list[tuple[str, int]], agent: str | None, net: str | None,
                    base: dict[str, str] | None = None, cores: int | None = None) -> dict[str, str]:
    """mpirun's environment for a job on `hosts`: root allowed (containers), the launch agent, the
    subnet, and -- when a host runs as many ranks as this machine has cores, or more (each rank also
    has an engine thread) -- Open MPI told to yield
    while it waits (its default busy polling starves the ranks that compute: measured 2 s against
    31 ms for 16 MB on 2 simulated hosts of a 2-core machine, issue 17). Settings the user made win."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
    if os.getuid() == 0:  # Open MPI refuses root unless told explicitly
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if agent:
        env.setdefault("PRTE_MCA_plm_ssh_agent", agent)  # Open MPI 5 (PRRTE)
        env.setdefault("OMPI_MCA_plm_rsh_agent", agent)  # Open MPI 4
    if net:
        for k in ("OMPI_MCA_btl_tcp_if_include", "PRTE_MCA_oob_tcp_if_include", "OMPI_MCA_oob_tcp_if_include"):
            env.setdefault(k, net)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) or 1
    per_host = max(min(n, np_) for _, n in hosts)
    if per_host >= cores and "OMPI_MCA_mpi_yield_when_idle" not in env:
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        say(f"fastxfer run: up to {per_host} ranks per host on {cores} cores: Open MPI set to yield while it "
            "waits (OMPI_MCA_mpi_yield_when_idle=1; set it yourself to choose)")
    return env


# What Open MPI (PRRTE) prints when it loses a host's daemon; it may then exit 0 all the same.
_LOST_HOST = [re.compile(r"Remote host:\s+(\S+)"),
              re.compile(r"Remote daemon:.*?on node\s+(\S+)"),
              re.compile(r"lost communication with a remote daemon.*?(?:on node|node)\s+(\S+)", re.I),
              re.compile(r"daemon on node\s+(\S+)\s+(?:failed|exited|died)", re.I)]
# What a rank prints when its heartbeats across hosts stop (csrc/transport/heartbeat.cc).
_RANK_LOST = re.compile(r"^fastxfer: rank (\d+): lost host (.+?) \(rank")
# mpirun gets this long to end the job by itself after a rank reported a lost host (it may wait for
# the lost host's daemon forever); then it is stopped.
LOST_HOST_GRACE_S = 5.0
_LOST_ANY = re.compile(r"daemon failed to report back|lost communication with a remote daemon|"
                       r"daemon on node \S+ (?:failed|exited|died)", re.I)


class _HostWatch:
    """Echoes mpirun's output (stdout and stderr: it prints its own help messages on stdout) and
    notes the hosts it says were lost."""

    def __init__(self, streams):
        self.lost: list[str] = []
        self.lost_any = False
        self.heartbeat_lost: list[str] = []     # hosts a rank's heartbeats lost
        self.heartbeat_rank: int | None = None  # the first rank that said so
        self.heartbeat_at: float | None = None  # when (time.monotonic())
        self.threads = [threading.Thread(target=self._pump, args=(src, dst), daemon=True) for src, dst in streams]
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)

    def _pump(self, stream, out):
        for line in iter(stream.readline, ""):
            try:
                out.write(line)
                out.flush()
            except OSError:
                pass
            if _LOST_ANY.search(line):
                self.lost_any = True
            m = _RANK_LOST.search(line)
            if m:
                for host in m.group(2).split(", "):
                    if host not in self.heartbeat_lost:
                        self.heartbeat_lost.append(host)
                if self.heartbeat_at is None:
                    self.heartbeat_rank, self.heartbeat_at = int(m.group(1)), time.monotonic()
            for pat in _LOST_HOST:
                m = pat.search(line)
                if m and m.group(1) not in self.lost:
                    self.lost.append(m.group(1))
        stream.close()


def run_mpirun(cmd: list[str], env: dict[str, str]) -> int:
    """Runs mpirun (which stops its own ranks on every host) so that it dies with the launcher and
    hears of a stop signal: SIGINT/SIGTERM/SIGHUP are forwarded to it as SIGTERM. A host that
    mpirun reports lost fails the job, naming the host, whatever mpirun's own exit status (Open MPI
    5 was seen to exit 0 after losing one); so does one a rank's heartbeats report lost, and then
    mpirun, which may wait for the lost host's daemon forever, is stopped after
    LOST_HOST_GRACE_S."""
    try:
        p = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent(os.getpid()), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, errors="replace")
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"fastxfer run: cannot start {cmd[0]!r}: {e}") from None
    watch = _HostWatch([(p.stdout, sys.stdout), (p.stderr, sys.stderr)])
    got: list[int] = []

    def forward(signum, _frame):
        got.append(signum)
        try:
            p.send_signal(signal.SIGTERM if len(got) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    stopped_at: float | None = None
    try:
        while True:
            try:
                code = p.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if watch.heartbeat_at is not None and now - watch.heartbeat_at > LOST_HOST_GRACE_S:
                if stopped_at is None:
                    stopped_at = now
                    p.terminate()
                elif now - stopped_at > 3:
                    p.kill()
        # mpirun's daemons on this machine may keep its pipes open a while after it was stopped
        watch.join(timeout=10 if stopped_at is None else 1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if watch.heartbeat_lost:
        hosts = ", ".join(dict.fromkeys(watch.heartbeat_lost + watch.lost))
        say(f"fastxfer run: job failed: lost host {hosts} (rank {watch.heartbeat_rank} heard no heartbeat from it: "
            f"its link or the host went down); mpirun {describe_exit(code)}"
            + (" (stopped by fastxfer run)" if stopped_at is not None else ""))
        return code if code > 0 else 1
    if watch.lost_any:
        hosts = ", ".join(watch.lost) if watch.lost else "a host"
        say(f"fastxfer run: job failed: lost {'host ' if watch.lost else ''}{hosts} (mpirun says its daemon "
            f"stopped answering: the host went down, its processes were killed or its link failed); mpirun "
            f"{describe_exit(code)}")
        return code if code > 0 else 1
    if got:
        say(f"fastxfer run: job stopped: the launcher {STOP_SIGNALS[got[0]]}; mpirun {describe_exit(code)}")
        return 128 + got[0]
    return 128 - code if code < 0 else code


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--np", dest="np", type=int, required=True, help="number of workers")
    p.add_argument("--bind", choices=["socket", "numa", "none"], default="none",
                   help="bind each worker to its cores and memory per `fastxfer topo --workers N` (socket: one "
                        "worker per socket when N matches, numa: per NUMA node when N matches, else even "
                        "splits) and set OMP/KMP/TF thread variables; default none")
    p.add_argument("--hosts", help="h1:n,h2:n — run through mpirun on these hosts")
    p.add_argument("--launch-agent", metavar="CMD",
                   help="with --hosts: an ssh-compatible command mpirun starts its daemons with (`CMD HOST "
                        "COMMAND...`), e.g. the simulated hosts' nsenter agent (python -m fastxfer.simhosts)")
    p.add_argument("--net", metavar="CIDR",
                   help="with --hosts: the subnet MPI's TCP traffic (and its daemons') must use, e.g. 10.0.0.0/24")
    p.add_argument("--min-np", type=int, metavar="M",
                   help="elastic: keep the job going while at least M workers remain (the script uses "
                        "fastxfer's elastic.run; docs/elastic.md)")
    p.add_argument("--max-np", type=int, metavar="K",
                   help="elastic: at most K workers in a generation (default -np)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="R",
                   help="elastic: start a new worker in a failed one's place, R times in all (default 0)")
    p.add_argument("--grace", type=float, default=float(os.environ.get("FASTXFER_GRACE", 10)),
                   help="seconds the other ranks get to stop by themselves after one fails (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command each worker runs")


def main(args: argparse.Namespace, elastic_job=None) -> int:
    """`fastxfer run`. ``elastic_job``: the class that runs an elastic job (run_elastic.ElasticJob;
    `fastxfer run` is started through run_elastic.main, which passes it)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("fastxfer run: no command given (fastxfer run -np 2 -- python train.py)")
    if args.np < 1:
        raise SystemExit(f"fastxfer run: -np must be at least 1, got {args.np}")
    if args.grace < 0:
        raise SystemExit("fastxfer run: --grace must be >= 0")
    try:
        segments.shm_dir()  # a bad FASTXFER_SHM_DIR is a usage error, before any rank starts
    except FastxferError as e:
        raise SystemExit(f"fastxfer run: {e}") from None
    sweep_stale_segments()
    sweep_stale_report_dirs()
    elastic = any(getattr(args, k, None) is not None for k in ("min_np", "max_np", "max_restarts"))
    if elastic and args.hosts:
        raise SystemExit("fastxfer run: elastic jobs (--min-np/--max-np/--max-restarts) run on one host for now; "
                         "across hosts, see docs/elastic.md for how it would run over MPI")
    if args.hosts:
        hosts = parse_hosts(args.hosts)
        cmd = mpirun_command(args.np, hosts, command)
        env = mpi_environment(args.np, hosts, args.launch_agent, args.net)
        return run_mpirun(cmd, env)
    if args.launch_agent or args.net:
        raise SystemExit("fastxfer run: --launch-agent and --net go with --hosts")
    placement = None
    if args.bind != "none":
        from fastxfer import topology
        from fastxfer.errors import TopologyError

        try:
            placement = topology.plan(args.np, prefer=args.bind)["workers"]
        except TopologyError as e:
            raise SystemExit(f"fastxfer run: cannot place {args.np} workers: {e}") from None
        for w in placement:
            print(f"fastxfer run: rank {w['local_rank']}: {w['numactl']}", file=sys.stderr, flush=True)
    if elastic:
        if elastic_job is None:
            raise SystemExit("fastxfer run: elastic options need fastxfer.run_elastic.main")
        min_np = args.np if args.min_np is None else args.min_np
        max_np = args.np if args.max_np is None else args.max_np
        restarts = args.max_restarts or 0
        if not 1 <= min_np <= args.np <= max_np:
            raise SystemExit(f"fastxfer run: need 1 <= --min-np ({min_np}) <= -np ({args.np}) <= --max-np ({max_np})")
        if restarts < 0:
            raise SystemExit("fastxfer run: --max-restarts must be >= 0")
        job = elastic_job(args.np, command, args.grace, min_np, max_np, restarts, placement=placement)
    else:
        job = Job(args.np, command, args.grace, placement=placement)
    job.catch_stop_signals()
    job.start()
    return job.wait()
