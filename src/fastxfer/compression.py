"""float32 <-> bf16 / fp16 conversion on the native SIMD kernels.

Rounding is to nearest, ties to even, bit-identical to ``array.astype(ml_dtypes.bfloat16)`` and
``array.astype(numpy.float16)`` for every input, including subnormals, signed zeros, infinities
and NaNs (bf16: every NaN becomes the sign-preserving canonical quiet NaN, as ml_dtypes does;
fp16: NaNs keep their top payload bits and are never turned into Inf, and values too large for
fp16 become +-Inf, as numpy does). Decompression is exact.
"""

from __future__ import annotations

import numpy as np

from fastxfer import _core
from fastxfer import _validate as check


def compress(array: np.ndarray, kind: str, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Round a float32 array to ``"bf16"`` (ml_dtypes.bfloat16) or ``"fp16"`` (numpy.float16).

    ``out``, if given, must be a C-contiguous writable array of the result dtype and the same
    shape; it is filled and returned. ``threads`` splits large arrays across that many threads
    (default: every CPU this process may run on). The GIL is released while converting.
    """
    kind = check.wire_kind(kind)
    array = check.exact_array(array, check.DTYPES["float32"], "array")
    nthreads = check.threads(threads)
    want = check.WIRE_DTYPES[kind]
    out = np.empty(array.shape, want) if out is None else check.out_array(out, array.shape, want)
    _core.compress_into(array, out, kind, 1.0, nthreads)
    return out


def decompress(array: np.ndarray, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Widen a bfloat16 or float16 array back to float32 (exact)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array must be a numpy.ndarray, not {type(array).__name__}")
    kind = "fp16" if array.dtype == check.WIRE_DTYPES["fp16"] else "bf16" if check.is_bfloat16(array.dtype) else None
    if kind is None:
        raise TypeError(f"array must have dtype bfloat16 or float16, not {array.dtype.name}")
    array = check.exact_array(array, array.dtype, "array")
    nthreads = check.threads(threads)
    want = check.DTYPES["float32"]
    out = np.empty(array.shape, want) if out is None else check.out_array(out, array.shape, want)
    _core.decompress_into(array, out, kind, 1.0, nthreads)
    return out
