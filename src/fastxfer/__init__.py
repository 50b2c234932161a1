"""fastxfer: fast data-parallel training for TensorFlow / Keras 3 on CPU clusters.

The framework-free API works on numpy arrays::

    import fastxfer as fx
    fx.init()                                   # joins the job started by `fastxfer run -np N`
    g = fx.allreduce(grad, op="average", compression="bf16")

Native core: SIMD bf16/fp16 kernels, fused gradient buckets (``fastxfer.fusion``), and a
background engine that reduces over shared memory.
"""

from fastxfer import _configure, _core
from fastxfer.comm import (Handle, ProcessSet, add_process_set, allgather, allgather_object, allreduce, allreduce_async,
                           alltoall, alltoall_async, barrier, broadcast, broadcast_object, engine_stats,
                           global_process_set, grouped_reducescatter, init, is_initialized, join, local_rank,
                           local_size, oob_allreduce, rank, reducescatter, remove_process_set, shutdown, size)
from fastxfer.compression import compress, decompress
from fastxfer.errors import (FastxferError, MismatchError, NotInProcessSetError, PeerFailureError,
                             ProcessSetRemovedError)

# The process-wide native settings (FASTXFER_SIMD, FASTXFER_THREADS, FASTXFER_OUTPUT_POOL_MB), read
# through fastxfer.settings and handed to the core before anything runs a kernel; a bad value fails
# the import with one line naming it (settings.SettingError).
_configure.configure_core()

__version__ = _core.__version__


def simd_level() -> str:
    """The active kernel path: ``scalar``, ``avx2``, ``avx512`` or ``avx512bf16``.

    The best path the CPU supports is chosen at import; ``FASTXFER_SIMD=<level>`` set before
    import forces a lower one (an unknown or unsupported level makes the import fail).
    """
    return _core.simd_level()


def supported_simd_levels() -> list[str]:
    """Every kernel path this CPU can run, slowest first."""
    return list(_core.supported_simd_levels())


__all__ = [
    "FastxferError",
    "Handle",
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
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "oob_allreduce",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
    "MismatchError",
    "NotInProcessSetError",
    "PeerFailureError",
    "ProcessSetRemovedError",
    "__version__",
    "compress",
    "decompress",
    "simd_level",
    "supported_simd_levels",
]
