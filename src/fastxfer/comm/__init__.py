"""Communication: joining the job (group), the collectives on numpy arrays, and the MPI bridge
between hosts. ``group`` knows nothing of the collectives; the collectives build on ``group``."""

from fastxfer.comm.collectives import (Handle, allgather, allreduce, allreduce_async, barrier, broadcast,
                                       broadcast_object, join, oob_allreduce)
from fastxfer.comm.group import (Layout, engine_stats, hosts, init, is_initialized, layout, local_rank, local_size,
                                 rank, shutdown, size)

__all__ = [
    "Handle",
    "Layout",
    "allgather",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_object",
    "engine_stats",
    "hosts",
    "init",
    "is_initialized",
    "join",
    "layout",
    "local_rank",
    "local_size",
    "oob_allreduce",
    "rank",
    "shutdown",
    "size",
]
