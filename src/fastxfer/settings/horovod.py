"""Horovod's environment variables, each with what it means here: honoured as the FASTXFER_* setting
it stands for (when that setting itself is unset), or named in one warning at ``init()`` saying
why it changes nothing (never silently ignored). docs/configuration.md lists them (generated).

Variables horovodrun sets for its workers to say where they sit (HOROVOD_RANK, _SIZE, ...) are
read by the launcher table instead (comm/launchers.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping


def _bytes_to_mb(v: str) -> str:
    n = int(v.strip())
    if n < 0:
        raise ValueError
    return repr(max(n, 1024) / (1 << 20))  # Horovod's 0 (no fusion): the smallest cap, 1 KiB


def _same(v: str) -> str:
    return v


def _timeline(v: str) -> str:
    return "" if v.strip().upper() == "DYNAMIC" else v  # DYNAMIC: started later by start_timeline()


def _stall_shutdown(v: str) -> str:
    n = float(v)
    return "" if n == 0 else v  # Horovod's 0: never shut down; here: the default timeout


def _disable_to_huge(v: str) -> str:
    return "1e9" if v.strip().lower() in ("1", "true", "yes", "on") else ""


@dataclasses.dataclass(frozen=True)
class HorovodVariable:
    name: str
    meaning: str                   # what it does here
    setting: str = ""              # the FASTXFER_* setting it stands for; "" when it changes nothing
    convert: Callable[[str], str] = _same  # Horovod's value -> the setting's ("" : the setting's default)


H = HorovodVariable
TABLE: tuple[HorovodVariable, ...] = (
    H("HOROVOD_TIMELINE", "the job's timeline file (DYNAMIC: none until start_timeline())", "FASTXFER_TIMELINE",
      _timeline),
    H("HOROVOD_TIMELINE_MARK_CYCLES", "mark every negotiation round on the timeline", "FASTXFER_TIMELINE_MARK_CYCLES"),
    H("HOROVOD_FUSION_THRESHOLD", "the fusion bucket cap, in bytes (0: 1 KiB, the smallest)", "FASTXFER_BUCKET_CAP_MB",
      _bytes_to_mb),
    H("HOROVOD_STALL_CHECK_TIME_SECONDS", "seconds before a stalled rank is warned about", "FASTXFER_STALL_WARNING_S"),
    H("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "seconds a silent peer is waited for before the others fail (0: the "
      "default)", "FASTXFER_TIMEOUT", _stall_shutdown),
    H("HOROVOD_STALL_CHECK_DISABLE", "no stall warnings (the timeout still holds)", "FASTXFER_STALL_WARNING_S",
      _disable_to_huge),
    H("HOROVOD_GLOO_TIMEOUT_SECONDS", "seconds the ranks get to find each other at init", "FASTXFER_ATTACH_TIMEOUT"),
    H("HOROVOD_ELASTIC_TIMEOUT", "seconds an elastic launcher waits for a member at the rendezvous",
      "FASTXFER_ELASTIC_TIMEOUT"),
    H("HOROVOD_LOG_LEVEL", "the level of fastxfer's logger (TRACE and DEBUG: debug, FATAL: critical)",
      "FASTXFER_LOG_LEVEL", lambda v: {"trace": "debug", "fatal": "critical"}.get(v.strip().lower(), v.strip().lower())),
    H("HOROVOD_DYNAMIC_PROCESS_SETS", "honoured always: process sets can be added and removed at any time"),
    H("HOROVOD_CYCLE_TIME", "no effect: fastxfer's engine has no background cycle; a collective starts as soon as "
      "every rank has submitted it"),
    H("HOROVOD_CACHE_CAPACITY", "no effect: no response cache, negotiation is one round in shared memory"),
    H("HOROVOD_HIERARCHICAL_ALLREDUCE", "no effect: the allreduce is always hierarchical across hosts"),
    H("HOROVOD_HIERARCHICAL_ALLGATHER", "no effect: the allgather is always hierarchical across hosts"),
    H("HOROVOD_AUTOTUNE", "no effect: no autotuner; the engine's settings have measured defaults "
      "(docs/algorithms.md)"),
    H("HOROVOD_AUTOTUNE_LOG", "no effect: no autotuner"),
    H("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "no effect: no autotuner"),
    H("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "no effect: no autotuner"),
    H("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "no effect: no autotuner"),
    H("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "no effect: no autotuner"),
    H("HOROVOD_CPU_OPERATIONS", "no effect: every collective runs on fastxfer's shared-memory engine (MPI only "
      "between hosts)"),
    H("HOROVOD_CONTROLLER", "no effect: negotiation runs in shared memory (MPI only between hosts)"),
    H("HOROVOD_MPI_THREADS_DISABLE", "no effect: MPI is initialised only between hosts, at the level fastxfer needs"),
    H("HOROVOD_THREAD_AFFINITY", "no effect: place the engine thread with FASTXFER_ENGINE_CPUS or fastxfer run --bind"),
    H("HOROVOD_NUM_NCCL_STREAMS", "no effect: NCCL is a GPU library"),
    H("HOROVOD_GPU_OPERATIONS", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_GPU_ALLREDUCE", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_GPU_ALLGATHER", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_GPU_BROADCAST", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_GPU_ALLTOALL", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_GPU_REDUCESCATTER", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_BATCH_D2D_MEMCOPIES", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_ENABLE_ASYNC_COMPLETION", "no effect: fastxfer runs on CPUs"),
    H("HOROVOD_ENABLE_XLA_OPS", "no effect: fastxfer has no XLA custom calls (docs/tensorflow.md)"),
    H("HOROVOD_ADASUM_MPI_CHUNK_SIZE", "no effect: no Adasum over MPI"),
    H("HOROVOD_DISABLE_GROUP_FUSION", "no effect: grouped collectives fuse like the rest"),
    H("HOROVOD_DISABLE_NVTX_RANGES", "no effect: no NVTX on CPUs"),
)
BY_NAME = {v.name: v for v in TABLE}
BY_SETTING: dict[str, list[HorovodVariable]] = {}
for _v in TABLE:
    if _v.setting:
        BY_SETTING.setdefault(_v.setting, []).append(_v)

# set by horovodrun (and `fastxfer run`) to say where a worker sits: the launcher table reads them
PLACE = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
         "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
         "HOROVOD_GLOO_IFACE", "HOROVOD_ELASTIC")


def alias_value(setting: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(Horovod variable, value for `setting`) when a Horovod variable that stands for `setting` is set
    (the first in the table's order), else None. ValueError names the variable when its value is bad."""
    for v in BY_SETTING.get(setting, ()):
        raw = environ.get(v.name)
        if raw is None or raw.strip() == "":
            continue
        try:
            converted = v.convert(raw)
        except ValueError:
            raise ValueError(v.name) from None
        if converted != "":
            return v.name, converted
    return None


def no_effect(environ: Mapping[str, str] | None = None) -> list[str]:
    """'NAME: why' for each Horovod variable that is set and changes nothing here, and each unknown one."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if not name.startswith("HOROVOD_") or name in PLACE or not env[name].strip():
            continue
        v = BY_NAME.get(name)
        if v is None:
            out.append(f"{name}: not a Horovod variable fastxfer knows; ignored")
        elif not v.setting and v.meaning.startswith("no effect"):
            out.append(f"{name}: {v.meaning}")
    return out
