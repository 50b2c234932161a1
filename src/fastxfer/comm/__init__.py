"""Communication: joining the job (group), the collectives on numpy arrays, and the MPI bridge
between hosts. ``group`` knows nothing of the collectives; the collectives build on ``group``."""

from fastxfer.comm.collectives import (Handle, allgather, allgather_object, allreduce, allreduce_async, alltoall,
                                       alltoall_async, barrier, broadcast, broadcast_object, grouped_reducescatter,
                                       join, oob_allreduce, reducescatter)
from fastxfer.comm.group import (Layout, engine_stats, hosts, init, is_initialized, layout, local_rank, local_size,
                                 rank, shutdown, size)
from fastxfer.comm.process_sets import ProcessSet, global_process_set
from fastxfer.comm.set_registration import add_process_set, remove_process_set
from fastxfer.comm import timeline  # noqa: E402,F401 - registers the timeline's start at init and merge at shutdown

__all__ = [
    "Handle",
    "Layout",
    "ProcessSet",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_object",
    "engine_stats",
    "global_process_set",
    "grouped_reducescatter",
    "hosts",
    "init",
    "is_initialized",
    "join",
    "layout",
    "local_rank",
    "local_size",
    "oob_allreduce",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
]
