"""``fastxfer run``: start N workers on this host (or hand off to mpirun for several hosts),
prefix their output with their rank, and stop the job when one of them fails.

When a worker fails, the others get a grace period (default 10 s) to notice through fastxfer
(they raise PeerFailureError within a second or so and exit); whoever is still running after it
is sent SIGTERM, then SIGKILL. The exit code is the first failed rank's (128 + signal number for
a signal), and the last line says which rank failed and how. Shared-memory segments of the job
are removed at the end, and segments of earlier jobs whose launcher is gone are swept at start.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "fastxfer-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def sweep_stale_segments() -> list[str]:
    """Remove this user's fastxfer segments whose creating launcher (pid in the name) is gone."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, SEGMENT_PREFIX + "*")):
        name = os.path.basename(path)[len(SEGMENT_PREFIX):]
        try:
            pid = int(name.split("-", 1)[0])
            if os.stat(path).st_uid != os.getuid() or _pid_alive(pid):
                continue
            os.unlink(path)
            removed.append(path)
        except (ValueError, OSError):
            continue
    return removed


def remove_job_segments(job_id: str) -> None:
    for path in glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{job_id}*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


class Job:
    def __init__(self, np_: int, command: list[str], grace: float, extra_env: dict[str, str] | None = None,
                 placement: list[dict] | None = None):
        self.np = np_
        self.command = command
        self.placement = placement  # per-rank plan from fastxfer.topology, or None (no binding)
        self.grace = grace
        self.job_id = f"{os.getpid()}-{secrets.token_hex(16)}"
        self.extra_env = extra_env or {}
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.interrupted: int | None = None
        self.exit_times: dict[int, float] = {}  # rank -> when it exited (a waiter thread per rank)
        # where a rank that gives up waiting names the rank that stalled (csrc/transport/shm/segment.cc)
        self.report_dir = tempfile.mkdtemp(prefix="fastxfer-report-")

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.placement is not None:
            for k, v in self.placement[rank]["env"].items():
                env.setdefault(k, v)  # the user's own settings win
        env.update({
            "FASTXFER_RANK": str(rank),
            "FASTXFER_SIZE": str(self.np),
            "FASTXFER_LOCAL_RANK": str(rank),
            "FASTXFER_LOCAL_SIZE": str(self.np),
            "FASTXFER_JOB_ID": self.job_id,
            "FASTXFER_REPORT_DIR": self.report_dir,
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def start(self) -> None:
        width = len(str(self.np - 1))
        for r in range(self.np):
            cmd = self.command
            if self.placement is not None:
                w = self.placement[r]
                # by file, not `-m`: `-m` would put the working directory first on sys.path
                bindexec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bindexec.py")
                cmd = [sys.executable, bindexec, "--cpus", w["cpus"], "--mems", ",".join(map(str, w["mem_nodes"])),
                       "--"] + cmd
            try:
                p = subprocess.Popen(cmd, env=self._env(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                self.signal_all(signal.SIGKILL)
                shutil.rmtree(self.report_dir, ignore_errors=True)
                raise SystemExit(f"fastxfer run: cannot start {self.command[0]!r}: {e.strerror}") from None
            self.procs.append(p)
            waiter = threading.Thread(target=self._wait_one, args=(r, p), daemon=True)
            waiter.start()
            prefix = f"[{r:>{width}}] ".encode()
            for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(stream, out, prefix, self.lock), daemon=True)
                t.start()
                self.pumps.append(t)

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
        self.interrupted = signum

    def wait(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        stop_at = term_at = kill_at = None
        try:
            while len(self.exit_times) < len(self.procs):
                now = time.monotonic()
                if stop_at is None:
                    failure = self._first_failure()
                    if failure is not None:
                        r, code = failure
                        with self.lock:
                            print(f"fastxfer run: rank {r} failed ({describe_exit(code)}); "
                                  f"giving the other ranks {self.grace:g} s to stop", file=sys.stderr, flush=True)
                        stop_at = now + self.grace
                if self.interrupted is not None and term_at is None:
                    stop_at = now
                if stop_at is not None and now >= stop_at and term_at is None:
                    self.signal_all(signal.SIGTERM)
                    term_at = now
                    kill_at = now + 5.0
                if kill_at is not None and now >= kill_at:
                    self.signal_all(signal.SIGKILL)
                    kill_at = now + 1.0
                time.sleep(0.05)
            for t in self.pumps:
                t.join(timeout=5)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            remove_job_segments(self.job_id)
            reports = self.stall_reports()
            shutil.rmtree(self.report_dir, ignore_errors=True)
        first = self._first_failure()
        if self.interrupted is not None:
            print(f"fastxfer run: interrupted by {signal.Signals(self.interrupted).name}; stopped all ranks",
                  file=sys.stderr, flush=True)
            return 128 + self.interrupted
        if first is None:
            return 0
        r, code = first
        others = [f"rank {i}: {describe_exit(p.returncode)}" for i, p in enumerate(self.procs) if i != r]
        if r in reports and reports[r][0] != r:
            # the first to fail gave up waiting: blame the rank it waited for, not the messenger
            culprit, msg = reports[r]
            print(f"fastxfer run: job failed: rank {culprit} stalled (named by rank {r}: {msg}); rank {r} gave up "
                  f"waiting for it ({describe_exit(code)})" + (f"; {', '.join(others)}" if others else ""),
                  file=sys.stderr, flush=True)
        else:
            print(f"fastxfer run: job failed: rank {r} failed first ({describe_exit(code)})"
                  + (f"; {', '.join(others)}" if others else ""), file=sys.stderr, flush=True)
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


def mpirun_command(np_: int, hosts: list[tuple[str, int]], command: list[str]) -> list[str]:
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise SystemExit("fastxfer run: --hosts hands the job to mpirun, which is not on PATH: install MPI "
                         "(pip install 'fastxfer[mpi]' brings Open MPI and mpi4py) and try again")
    if sum(n for _, n in hosts) < np_:
        raise SystemExit(f"fastxfer run: --hosts offers {sum(n for _, n in hosts)} slots for -np {np_}")
    host_arg = ",".join(f"{h}:{n}" for h, n in hosts)
    return [mpirun, "-np", str(np_), "--host", host_arg, "-x", "PYTHONUNBUFFERED=1"] + command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--np", dest="np", type=int, required=True, help="number of workers")
    p.add_argument("--bind", choices=["socket", "numa", "none"], default="none",
                   help="bind each worker to its cores and memory per `fastxfer topo --workers N` (socket: one "
                        "worker per socket when N matches, numa: per NUMA node when N matches, else even "
                        "splits) and set OMP/KMP/TF thread variables; default none")
    p.add_argument("--hosts", help="h1:n,h2:n — run through mpirun on these hosts")
    p.add_argument("--grace", type=float, default=float(os.environ.get("FASTXFER_GRACE", 10)),
                   help="seconds the other ranks get to stop by themselves after one fails (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command each worker runs")


def main(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("fastxfer run: no command given (fastxfer run -np 2 -- python train.py)")
    if args.np < 1:
        raise SystemExit(f"fastxfer run: -np must be at least 1, got {args.np}")
    if args.grace < 0:
        raise SystemExit("fastxfer run: --grace must be >= 0")
    sweep_stale_segments()
    if args.hosts:
        cmd = mpirun_command(args.np, parse_hosts(args.hosts), command)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if os.getuid() == 0:  # Open MPI refuses root unless told explicitly
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        return subprocess.call(cmd, env=env)
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
    job = Job(args.np, command, args.grace, placement=placement)
    job.start()
    return job.wait()
