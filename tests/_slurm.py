"""A real one-node Slurm for the launcher tests: munged, slurmctld and slurmd (Debian's packages,
installed by .ci/launchers.sh), configured in a private folder, started as root and stopped at the
end. Nothing of the machine's own Slurm configuration is read or changed."""

import os
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd", "srun")


def missing() -> str | None:
    """Why Slurm cannot run here, or None."""
    if os.getuid() != 0:
        return "needs root (slurmd runs jobs as any user)"
    absent = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if absent:
        return f"needs {', '.join(absent)} (bash .ci/launchers.sh installs Slurm and munge)"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One node (this machine, all its CPUs), one partition; `env` points Slurm's commands at it."""

    def __init__(self, folder: str):
        self.dir = folder
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "munge"):
            os.makedirs(os.path.join(folder, sub), mode=0o700, exist_ok=True)
        self.munge_socket = os.path.join(folder, "munge", "munge.socket")
        key = os.path.join(folder, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        ctld_port, d_port = _free_port(), _free_port()
        conf = f"""ClusterName=fastxfer-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""
        self.conf = os.path.join(folder, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]
        self.procs = []

    def start(self, timeout: float = 60) -> None:
        self.procs.append(subprocess.Popen(
            [_exe("munged"), "-F", f"--socket={self.munge_socket}", f"--key-file={self.dir}/munge/munge.key",
             f"--pid-file={self.dir}/munge/munged.pid", f"--log-file={self.dir}/munge/munged.log",
             f"--seed-file={self.dir}/munge/munged.seed", "--force"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.munge_socket):
            self._check(deadline, "munged")
        for daemon in ("slurmctld", "slurmd"):
            self.procs.append(subprocess.Popen([_exe(daemon), "-D", "-f", self.conf], env=self.env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True))
        while True:  # the node is up when sinfo says it is idle
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip() in ("idle", "mix"):
                return
            self._check(deadline, "slurmctld/slurmd")

    def _check(self, deadline: float, what: str) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what} exited with {p.returncode}; logs in {self.dir}\n{self.logs()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up; logs in {self.dir}\n{self.logs()}")
        time.sleep(0.2)

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
            try:
                with open(os.path.join(self.dir, name)) as f:
                    out.append(f"--- {name} ---\n" + f.read()[-2000:])
            except OSError:
                pass
        return "\n".join(out)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
