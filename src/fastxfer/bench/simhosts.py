"""Simulated hosts on one Linux machine, for running fastxfer's multi-host path across a real
(virtual) network: each host is a long-lived process in its own network, UTS and mount namespaces,
with its own host name, its own tmpfs on /dev/shm and its own /etc/hosts; veth pairs (two hosts)
or a bridge in a namespace of its own (more) connect them on a private subnet. Nothing leaves the
machine and nothing outside the namespaces made here is touched. Needs root (CAP_SYS_ADMIN,
CAP_NET_ADMIN) and iproute2.

Jobs start with ``fastxfer run --hosts h1:2,h2:2 --launch-agent AGENT --net SUBNET`` run inside the
first host: mpirun there reaches the others through AGENT, an ssh-compatible script that enters a
host's namespaces with nsenter.

From a shell::

    sudo python -m fastxfer.bench.simhosts --hosts 2 --slots 2 -- python train.py
    # = fastxfer run -np 4 --hosts h1:2,h2:2 ... -- python train.py, on two simulated hosts

``SimHosts`` is the same from Python (the tests use it); ``SimHosts.available()`` says why not,
where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET = "10.77.0"  # /24, inside the namespaces only


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def tc_path() -> str | None:
    """iproute2's tc: on PATH, or in the sbin directories a user's PATH often leaves out."""
    return shutil.which("tc") or shutil.which("tc", path="/usr/sbin:/sbin:/usr/local/sbin")


class SimHosts:
    """``n`` simulated hosts named h1..hn at SUBNET.1..n; a context manager (``up``/``down``)."""

    def __init__(self, n: int = 2, shm_mb: int = 256, prefix: str = "h"):
        if n < 1:
            raise ValueError("at least one host")
        self.n = n
        self.shm_mb = shm_mb
        self.names = [f"{prefix}{i + 1}" for i in range(n)]
        self.dir = ""
        self.procs: list[subprocess.Popen] = []
        self.switch: subprocess.Popen | None = None
        self.tag = f"fx{os.getpid() % 100000}"

    # -- availability ---------------------------------------------------------------------------
    _why: str | None = None
    _checked = False

    @classmethod
    def available(cls) -> str | None:
        """None when simulated hosts can be made here, else why not. The first call builds two
        hosts and tears them down again: a container may allow namespaces but not links."""
        if cls._checked:
            return cls._why
        cls._checked = True
        if os.geteuid() != 0:
            cls._why = "simulated hosts need root (network, UTS and mount namespaces)"
        else:
            for tool in ("unshare", "nsenter", "ip"):
                if shutil.which(tool) is None:
                    cls._why = f"{tool} is not installed"
                    return cls._why
            try:
                with cls(2):
                    pass
            except Exception as e:  # any reason at all: the caller skips with it
                cls._why = f"cannot build simulated hosts here: {e}"
        return cls._why

    # -- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "SimHosts":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def net(self) -> str:
        return f"{SUBNET}.0/24"

    def _spawn(self, hostname: str, shm: bool) -> subprocess.Popen:
        script = [f"hostname {hostname}", "mount --make-rprivate /", "ip link set lo up"]
        if shm:
            script += [f"mount -t tmpfs -o size={self.shm_mb}m,mode=1777 tmpfs /dev/shm",
                       f"mount --bind {self.dir}/hosts /etc/hosts"]
        script.append("echo ready; exec sleep infinity")
        p = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "sh", "-c", "; ".join(script)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = p.stdout.readline()
        if line.strip() != "ready":
            err = p.stderr.read() if p.poll() is not None else ""
            p.kill()
            raise RuntimeError(f"simulated host {hostname} did not start: {err.strip()}")
        return p

    def up(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("simulated hosts need root (network, UTS and mount namespaces)")
        self.dir = tempfile.mkdtemp(prefix="fastxfer-simhosts-")
        with open(os.path.join(self.dir, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            for i, name in enumerate(self.names):
                f.write(f"{self.address(i)} {name}\n")
        try:
            for name in self.names:
                self.procs.append(self._spawn(name, shm=True))
            self._connect()
            self._wait_for_links()
            self._write_agent()
        except BaseException:
            self.down()
            raise

    def _connect(self) -> None:
        # Every link is made inside a namespace of ours and its other end moved into another: the
        # caller's network namespace never holds a device of ours, not even for a moment.
        if self.n == 1:
            return
        if self.n == 2:  # one veth pair, h1's eth0 to h2's eth0
            p1, p2 = str(self.procs[0].pid), str(self.procs[1].pid)
            _run(["nsenter", "-t", p1, "-n", "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
                  "netns", p2])
            for i in range(2):
                self._address(i)
            return
        self.switch = self._spawn(f"{self.tag}-switch", shm=False)
        sw = str(self.switch.pid)
        _run(["nsenter", "-t", sw, "-n", "ip", "link", "add", "br0", "type", "bridge"])
        _run(["nsenter", "-t", sw, "-n", "ip", "link", "set", "br0", "up"])
        for i in range(self.n):
            port = f"port{i}"
            _run(["nsenter", "-t", sw, "-n", "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", str(self.procs[i].pid)])
            _run(["nsenter", "-t", sw, "-n", "ip", "link", "set", port, "master", "br0"])
            _run(["nsenter", "-t", sw, "-n", "ip", "link", "set", port, "up"])
            self._address(i)

    def _wait_for_links(self, timeout: float = 20.0) -> None:
        """Until every host's eth0 has its carrier (state UP, both ends up): a job launched before
        that saw mpirun's daemon on h2 fail to connect back ("A daemon failed to report back")."""
        if self.n == 1:
            return
        deadline = time.monotonic() + timeout
        waiting = list(range(self.n))
        while waiting:
            waiting = [i for i in waiting
                       if " UP " not in _run(["nsenter", "-t", str(self.procs[i].pid), "-n", "ip", "-br", "link", "show",
                                              "eth0"]).stdout + " "]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"simulated hosts: the link of {', '.join(self.names[i] for i in waiting)} did not "
                                   f"come up within {timeout:g} s")
            if waiting:
                time.sleep(0.05)

    def _address(self, i: int) -> None:
        pid = str(self.procs[i].pid)
        _run(["nsenter", "-t", pid, "-n", "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
        _run(["nsenter", "-t", pid, "-n", "ip", "link", "set", "eth0", "up"])

    def _write_agent(self) -> None:
        table = " ".join(f"{name}) pid={p.pid} ;;" for name, p in zip(self.names, self.procs))
        script = f"""#!/bin/sh
# ssh-compatible launch agent for fastxfer's simulated hosts: agent [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1; shift
case "$host" in {table} *) echo "no simulated host $host" >&2; exit 255 ;; esac
exec nsenter -t "$pid" -n -u -m -- sh -c "$*"
"""
        self.agent = os.path.join(self.dir, "agent")
        with open(self.agent, "w") as f:
            f.write(script)
        os.chmod(self.agent, 0o755)

    def down(self) -> None:
        """Stop every host (their namespaces, veths and /dev/shm go with them) and the temp files.
        Every process inside a host goes too: a job cut off from its launcher (a link taken down)
        leaves its ranks and daemon there, and they would hold the namespace."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill_host(i)
        for p in self.procs + ([self.switch] if self.switch else []):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
        self.procs, self.switch = [], None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    # -- running things --------------------------------------------------------------------------
    def pid(self, host: int | str) -> int:
        i = self.names.index(host) if isinstance(host, str) else host
        return self.procs[i].pid

    def command(self, host: int | str, cmd: list[str]) -> list[str]:
        """`cmd` as run inside a host's namespaces."""
        return ["nsenter", "-t", str(self.pid(host)), "-n", "-u", "-m", "--", *cmd]

    def fastxfer_run(self, slots: int, cmd: list[str], np_: int | None = None, extra: tuple = ()) -> list[str]:
        """`fastxfer run -np N --hosts h1:s,h2:s,... --launch-agent ... --net ... -- cmd`, started on h1."""
        np_ = np_ or slots * self.n
        hosts = ",".join(f"{name}:{slots}" for name in self.names)
        run = [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(np_), "--hosts", hosts, "--launch-agent",
               self.agent, "--net", self.net, *extra, "--", *cmd]
        # every simulated host shares this machine's cores: once the job as a whole outnumbers them,
        # Open MPI's busy polling starves the ranks that compute (fastxfer run only sees one host's share)
        env = []
        if np_ >= (len(os.sched_getaffinity(0)) or 1) and "OMPI_MCA_mpi_yield_when_idle" not in os.environ:
            env.append("OMPI_MCA_mpi_yield_when_idle=1")
        # and each host's daemon binds its k-th rank to core k, the same core on every host: the ranks
        # that talk across the link would share one core while the other sits idle (2 hosts x 1 rank,
        # 4 KiB: 0.16-0.19 ms per allreduce bound, 0.07 ms unbound; Open MPI's own 0.08-0.11 and 0.06).
        # Real hosts have cores of their own: the kernel places the ranks here. Set it to choose.
        if "PRTE_MCA_hwloc_default_binding_policy" not in os.environ:
            env.append("PRTE_MCA_hwloc_default_binding_policy=none")
        if env:
            run = ["env", *env, *run]
        return self.command(0, run)

    def limit_rate(self, rate_text: str, bits: float) -> None:
        """A tc token bucket of `bits` per second (`rate_text`, tc's spelling) on every host's link."""
        tc = tc_path()
        if tc is None:
            raise RuntimeError("tc (iproute2) is not installed")
        # a bucket of 4 ms at the rate (at least 32 KiB): small enough that bursts do not hide the rate
        burst = max(32 << 10, int(bits / 8 / 250))
        for i in range(self.n):
            r = subprocess.run(self.command(i, [tc, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate_text,
                                                "burst", str(burst), "latency", "200ms"]), capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"tc cannot limit the link here: {r.stderr.strip()}")

    def unlimit(self) -> None:
        """Every host's link back to full speed."""
        for i in range(self.n):
            subprocess.run(self.command(i, [tc_path() or "tc", "qdisc", "del", "dev", "eth0", "root"]), capture_output=True)

    def shm_files(self, host: int | str) -> list[str]:
        """What a host's /dev/shm holds now."""
        return _run(self.command(host, ["ls", "-A", "/dev/shm"])).stdout.split()

    def kill_host(self, host: int | str) -> None:
        """Every process of a host, as if it lost power: all processes in its network namespace."""
        pid = self.pid(host)
        ns = os.readlink(f"/proc/{pid}/ns/net")
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != pid:
                try:
                    if os.readlink(f"/proc/{d}/ns/net") == ns:
                        os.kill(int(d), signal.SIGKILL)
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.simhosts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2, help="number of simulated hosts (default 2)")
    ap.add_argument("--slots", type=int, default=2, help="ranks per host (default 2)")
    ap.add_argument("--shm-mb", type=int, default=256, help="each host's /dev/shm size (default 256)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command every rank runs")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command (python -m fastxfer.bench.simhosts --hosts 2 -- python train.py)")
    why = SimHosts.available()
    if why:
        print(f"fastxfer.bench.simhosts: {why}", file=sys.stderr)
        return 2
    with SimHosts(args.hosts, args.shm_mb) as sim:
        print(f"fastxfer.bench.simhosts: {', '.join(f'{n} ({sim.address(i)})' for i, n in enumerate(sim.names))} up; "
              f"running {shlex.join(cmd)}", file=sys.stderr, flush=True)
        t = time.monotonic()
        code = subprocess.call(sim.fastxfer_run(args.slots, cmd))
        print(f"fastxfer.bench.simhosts: exit code {code} after {time.monotonic() - t:.1f} s; hosts torn down",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
