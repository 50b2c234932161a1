"""Which launcher started this process, and what it announced: the one table of every launcher
fastxfer recognises (docs/launchers.md has the same table with a launch line for each).

Each row reads the variables its launcher sets in every process it starts. A launcher that wires
MPI (mpirun, mpiexec, ``srun --mpi=pmix``) lets the ranks find each other through mpi4py, on one
host or several; one that does not (plain ``srun``, ``torchrun``, a TF_CONFIG job, horovodrun's
gloo mode) has its ranks of one host meet without MPI (comm/host_rendezvous.py), and a job it
spreads over several hosts stops with an error that names the launch line to use instead.

A process that a launcher announces as one of several never runs alone: either the job forms, or
``init()`` raises an error naming the launcher, the size it announced and the fix (group.py).

Where several launchers' variables are present (``srun`` starting mpirun's daemons, horovodrun
running over mpirun, ``srun torchrun``), the innermost launcher wins: rows are tried in order,
MPI launchers first, and an MPI launcher's numbers that equal Slurm's mean srun itself started
the process through its PMI plugin (then the Slurm row describes it better).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable

from fastxfer.errors import FastxferError

MPI_LINES = ("mpirun -np N python train.py, or fastxfer run -np N --hosts h1:n,h2:n -- python train.py, or "
             "srun --mpi=pmix -n N python train.py")


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What a launcher told this process about the job."""

    launcher: str            # the launcher's name as users know it ("Slurm srun", "torchrun", ...)
    rank: int
    size: int
    local_rank: int | None   # None: the launcher does not say; MPI finds it by host identity
    local_size: int | None
    nodes: int | None        # hosts the launcher spread the job over, where it says
    mpi: bool                # the launcher wired MPI: mpi4py's COMM_WORLD is this job
    key: str                 # names this job step on this host, for the rendezvous without MPI
    variables: tuple[str, ...]  # the variables the numbers came from, for error messages

    @property
    def one_host(self) -> bool:
        """Whether the launcher says every rank runs on this host."""
        if self.nodes is not None:
            return self.nodes == 1
        return self.local_size is not None and self.local_size == self.size

    def describe(self) -> str:
        return f"{self.launcher} ({', '.join(self.variables)}) says rank {self.rank} of {self.size}"


def _env(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v is not None and v.strip() != "" else None


def _int(name: str, launcher: str) -> int | None:
    v = _env(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise FastxferError(f"{launcher} set {name}={v!r}, which is not an integer") from None


def _first_int(names: tuple[str, ...], launcher: str) -> tuple[int | None, str | None]:
    for n in names:
        v = _int(n, launcher)
        if v is not None:
            return v, n
    return None, None


def _check(a: Announcement) -> Announcement:
    if a.size < 1 or not 0 <= a.rank < a.size:
        raise FastxferError(f"{a.describe()}: the rank is outside 0..size-1")
    if a.local_size is not None and a.local_rank is not None and not 0 <= a.local_rank < a.local_size:
        raise FastxferError(f"{a.launcher} says local rank {a.local_rank} of {a.local_size} on this host: the local "
                            "rank is outside 0..local size-1")
    return a


# ---- the rows --------------------------------------------------------------------------------------

def open_mpi() -> Announcement | None:
    """Open MPI's mpirun/mpiexec/prterun (and Kubernetes' MPIJob, which runs mpirun)."""
    name = "Open MPI mpirun"
    rank, size = _int("OMPI_COMM_WORLD_RANK", name), _int("OMPI_COMM_WORLD_SIZE", name)
    if rank is None or size is None:
        return None
    return Announcement(name, rank, size, _int("OMPI_COMM_WORLD_LOCAL_RANK", name),
                        _int("OMPI_COMM_WORLD_LOCAL_SIZE", name), None, True, "",
                        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


def hydra() -> Announcement | None:
    """MPICH's and Intel MPI's Hydra (mpiexec, mpiexec.hydra, mpirun), and any PMI-1/PMI-2 launcher."""
    name = "Intel MPI mpiexec" if _env("I_MPI_HYDRA_UUID") or _env("I_MPI_ROOT") else "MPICH mpiexec"
    rank, size = _int("PMI_RANK", name), _int("PMI_SIZE", name)
    if rank is None or size is None:
        return None
    return Announcement(name, rank, size, _int("MPI_LOCALRANKID", name), _int("MPI_LOCALNRANKS", name), None, True,
                        "", ("PMI_RANK", "PMI_SIZE"))


def horovodrun() -> Announcement | None:
    """horovodrun in its gloo mode (in its MPI mode Open MPI's variables come first)."""
    name = "horovodrun"
    rank, size = _int("HOROVOD_RANK", name), _int("HOROVOD_SIZE", name)
    if rank is None or size is None:
        return None
    cross = _int("HOROVOD_CROSS_SIZE", name)
    addr = f"{_env('HOROVOD_GLOO_RENDEZVOUS_ADDR')}:{_env('HOROVOD_GLOO_RENDEZVOUS_PORT')}"
    return Announcement(name, rank, size, _int("HOROVOD_LOCAL_RANK", name), _int("HOROVOD_LOCAL_SIZE", name), cross,
                        False, f"horovod/{addr}", ("HOROVOD_RANK", "HOROVOD_SIZE"))


def torchrun() -> Announcement | None:
    """torchrun / torch.distributed.run / torch elastic agents (and launchers that mimic them:
    RANK, WORLD_SIZE and MASTER_ADDR together)."""
    name = "torchrun"
    run_id = _env("TORCHELASTIC_RUN_ID")
    if run_id is None and not (_env("RANK") and _env("WORLD_SIZE") and _env("MASTER_ADDR")):
        return None
    rank, size = _int("RANK", name), _int("WORLD_SIZE", name)
    if rank is None or size is None:
        raise FastxferError(f"{name} (TORCHELASTIC_RUN_ID={run_id}) did not set RANK and WORLD_SIZE")
    local_rank, local_size = _int("LOCAL_RANK", name), _int("LOCAL_WORLD_SIZE", name)
    nodes = None
    if local_size:
        nodes = -(-size // local_size)
    key = (f"torch/{run_id}/{_env('MASTER_ADDR')}:{_env('MASTER_PORT')}/"
           f"{_env('TORCHELASTIC_RESTART_COUNT') or 0}/{_env('GROUP_RANK') or 0}")
    return Announcement(name, rank, size, local_rank, local_size, nodes, False, key,
                        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


_TF_ROLES = ("chief", "worker")  # the data-parallel tasks, in MultiWorkerMirroredStrategy's rank order


def tf_config() -> Announcement | None:
    """TF_CONFIG (Kubeflow's TFJob, Vertex AI, SageMaker's MWMS mode): the chief, then the workers."""
    name = "TF_CONFIG"
    raw = _env("TF_CONFIG")
    if raw is None:
        return None
    try:
        spec = json.loads(raw)
        cluster, task = spec.get("cluster") or {}, spec.get("task") or {}
        role, index = task.get("type"), int(task.get("index", 0))
        tasks = [(r, i, str(addr)) for r in _TF_ROLES for i, addr in enumerate(cluster.get(r) or [])]
    except (ValueError, TypeError, AttributeError) as e:
        raise FastxferError(f"TF_CONFIG is not a cluster spec with a task ({e}): {raw[:200]}") from None
    if not tasks:  # a TF_CONFIG without a cluster (a local test setting): not a launch
        return None
    if role not in _TF_ROLES:
        raise FastxferError(f"TF_CONFIG makes this process a {role!r} task; fastxfer trains data-parallel on the "
                            f"chief and worker tasks only (no parameter servers or evaluators in its job)")
    mine = [k for k, (r, i, _) in enumerate(tasks) if (r, i) == (role, index)]
    if not mine:
        raise FastxferError(f"TF_CONFIG's task {role}:{index} is not in its cluster spec")
    rank = mine[0]
    hosts = [addr.rsplit(":", 1)[0] for _, _, addr in tasks]
    order = list(dict.fromkeys(hosts))
    here = hosts[rank]
    local = [k for k, h in enumerate(hosts) if h == here]
    key = "tfconfig/" + json.dumps(cluster, sort_keys=True)
    return Announcement(name, rank, len(tasks), local.index(rank), len(local), len(order), False, key,
                        ("TF_CONFIG",))


_SLURM_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def slurm_tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The number of tasks on node `node` from Slurm's compressed list ("2(x3),1": 2, 2, 2, 1)."""
    counts = []
    for part in tasks_per_node.split(","):
        m = _SLURM_TASKS.match(part.strip())
        if not m:
            raise FastxferError(f"Slurm's SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} is not a task list")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node < len(counts):
        raise FastxferError(f"Slurm's SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node]


def slurm() -> Announcement | None:
    """Slurm's srun, with or without --mpi= (a job step's task; an sbatch script or an salloc shell
    is one process, not a step: it sets no SLURM_STEP_NUM_TASKS)."""
    size, size_var = _first_int(("SLURM_STEP_NUM_TASKS",), "Slurm srun")
    rank = _int("SLURM_PROCID", "Slurm srun")
    if size is None or rank is None:
        return None
    pmi = "pmix" if _env("PMIX_RANK") else "pmi2" if _env("PMI_FD") or _env("PMI_RANK") else None
    name = f"Slurm srun --mpi={pmi}" if pmi else "Slurm srun"
    nodes = _int("SLURM_STEP_NUM_NODES", name)
    local_rank = _int("SLURM_LOCALID", name)
    local_size = None
    per_node, node = _env("SLURM_STEP_TASKS_PER_NODE"), _int("SLURM_NODEID", name)
    if per_node is not None and node is not None:
        local_size = slurm_tasks_on_node(per_node, node)
    key = f"slurm/{_env('SLURM_JOB_ID')}.{_env('SLURM_STEP_ID') or _env('SLURM_STEPID')}"
    return Announcement(name, rank, size, local_rank, local_size, nodes, pmi == "pmix", key,
                        ("SLURM_PROCID", size_var))


def pmix() -> Announcement | None:
    """A PMIx launcher that sets no other variable (PMIX_RANK; the size comes from MPI)."""
    rank = _int("PMIX_RANK", "a PMIx launcher")
    if rank is None:
        return None
    return Announcement("a PMIx launcher", rank, 0, None, None, None, True, "", ("PMIX_RANK",))


@dataclasses.dataclass(frozen=True)
class Row:
    launcher: str
    variables: str
    meets: str
    read: Callable[[], Announcement | None]


# Tried in this order; the first that finds its variables describes the process (see the docstring).
TABLE = (
    Row("Open MPI mpirun / mpiexec / prterun", "OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE",
        "MPI, on one host or several", open_mpi),
    Row("MPICH or Intel MPI mpiexec (Hydra), PMI-1/PMI-2", "PMI_RANK, PMI_SIZE (Intel MPI: MPI_LOCALRANKID, "
        "MPI_LOCALNRANKS)", "MPI, on one host or several", hydra),
    Row("horovodrun (gloo mode)", "HOROVOD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE, _CROSS_SIZE",
        "one host: without MPI; several: error", horovodrun),
    Row("torchrun / torch elastic", "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID, "
        "MASTER_ADDR, MASTER_PORT", "one host: without MPI; several: error", torchrun),
    Row("TF_CONFIG (TFJob, MultiWorkerMirroredStrategy clusters)", "TF_CONFIG's cluster (chief, worker) and task",
        "one host: without MPI; several: error", tf_config),
    Row("Slurm srun (--mpi=none, pmi2 or pmix)", "SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID, "
        "SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NUM_NODES", "one node: without MPI; several: MPI with --mpi=pmix, "
        "else error", slurm),
    Row("other PMIx launchers", "PMIX_RANK (the size from MPI)", "MPI", pmix),
)


def announcements() -> list[Announcement]:
    """Every launcher's announcement found in the environment, in the table's order."""
    found = []
    for row in TABLE:
        a = row.read()
        if a is not None:
            found.append(a)
    return found


def detect() -> Announcement | None:
    """The launcher that started this process (the innermost, see the module docstring), or None."""
    found = announcements()
    if not found:
        return None
    by_name = {a.launcher.split(" --mpi")[0]: a for a in found}
    first = found[0]
    srun = by_name.get("Slurm srun")
    if srun is not None and first.mpi and first.launcher != srun.launcher and first.launcher != "a PMIx launcher" \
            and (first.rank, first.size) == (srun.rank, srun.size):
        first = srun  # srun started this process itself, through its PMI plugin: Slurm's row says more
    elif srun is not None and first.launcher == "a PMIx launcher":
        first = srun
    return _check(first) if first.size else first
