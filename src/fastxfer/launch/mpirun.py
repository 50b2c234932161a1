"""``fastxfer run --hosts h1:n,h2:n``: the job handed to mpirun, which starts the ranks on every
host; the launcher watches it, names a host that was lost, and passes its exit code on.

mpirun dies with the launcher and hears of a stop signal (forwarded as SIGTERM); it stops the ranks
on every host itself. Every FASTXFER_* setting goes to the ranks on every host.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from fastxfer.launch import horovod_flags
from fastxfer.launch.job import STOP_SIGNALS, die_with_parent
from fastxfer.launch.output import describe_exit, exit_code, say


def run(np_: int, command: list[str], hosts: str, agent: str | None, net: str | None, extra: list[str] = (),
        output_dir: str | None = None) -> int:
    """Runs `command` as N ranks on `hosts` ("h1:n,h2:n") through mpirun, its daemons started with
    `agent` (ssh-compatible) when given, MPI's traffic kept on subnet `net` when given; returns the
    job's exit code. `extra`: more mpirun arguments (horovodrun's --mpi-args, -p, --network-interface);
    `output_dir`: mpirun also writes each rank's output there (--output-filename). Each rank is
    started through launch/rank_env.py, which gives it horovodrun's HOROVOD_* place variables."""
    slots = parse_hosts(hosts)
    extra = list(extra) + (["--output-filename", output_dir] if output_dir else [])
    cmd = mpirun_command(np_, slots, [sys.executable, "-m", "fastxfer.launch.rank_env", "--", *command], extra=extra)  # no mpirun, or too few slots: before anything is said
    if agent is None:  # a launch agent (the simulated hosts') knows names of its own
        check_resolvable([h for h, _ in slots])
    env = mpi_environment(np_, slots, agent, net)
    return run_mpirun(cmd, env)


def _ssh_hostname(name: str) -> str | None:
    """The host name ssh would connect to for `name` (a Host alias in ~/.ssh/config), or None."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
    try:
        r = subprocess.run([ssh, "-G", name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in r.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip() and value.strip() != name:
            return value.strip()
    return None


def check_resolvable(names: list[str]) -> None:
    """SystemExit naming every host of --hosts that neither DNS, /etc/hosts nor an ssh alias resolves:
    said before mpirun starts, instead of its daemons failing as if the host had gone down."""
    bad = []
    for name in dict.fromkeys(names):
        if horovod_flags.is_this_host(name):
            continue
        try:
            socket.getaddrinfo(name, None)
            continue
        except (socket.gaierror, UnicodeError) as e:
            why = e.strerror if isinstance(e, socket.gaierror) and e.strerror else str(e)
        alias = _ssh_hostname(name)
        if alias is not None:
            try:
                socket.getaddrinfo(alias, None)
                continue
            except (socket.gaierror, UnicodeError):
                pass
        bad.append(f"{name!r} ({why})")
    if bad:
        raise SystemExit(f"fastxfer run: --hosts: cannot resolve {', '.join(bad)}: no such name in DNS, "
                         "/etc/hosts or ~/.ssh/config; check the spelling, or give the address")


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """[(host, slots)] from --hosts' "h1:n,h2" (a host without a count has one slot)."""
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
                   env: dict[str, str] | None = None, extra: list[str] = ()) -> list[str]:
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
    return [mpirun, "-np", str(np_), "--host", host_arg, "-x", "PYTHONUNBUFFERED=1", *forward, *extra] + command


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


class HostWatch:
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
    watch = HostWatch([(p.stdout, sys.stdout), (p.stderr, sys.stderr)])
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
    return exit_code(code)
