"""fastxfer: fast data-parallel training for TensorFlow / Keras 3 on CPU clusters and GPU nodes.

The framework-free API works on numpy arrays. This release provides the native core: SIMD
bf16/fp16 compression kernels and fused gradient buckets (``fastxfer.fusion``).
"""

try:
    from fastxfer import _core
except ImportError as e:  # pragma: no cover - depends on how the package was found
    import os as _os

    if "_core" in str(e) and not any(n.startswith("_core") for n in _os.listdir(_os.path.dirname(__file__))):
        raise ImportError(
            f"fastxfer's native module is not built next to {_os.path.dirname(__file__)}: this is the source "
            "tree, not the installed package. Install it (pip install .) and run from outside the checkout, "
            "or run the tests with `pytest` rather than `python -m pytest` (which puts the checkout first)."
        ) from e
    raise
from fastxfer.compression import compress, decompress
from fastxfer.errors import FastxferError, MismatchError, PeerFailureError

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
    "MismatchError",
    "PeerFailureError",
    "__version__",
    "compress",
    "decompress",
    "simd_level",
    "supported_simd_levels",
]
