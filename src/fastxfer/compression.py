"""float32 <-> bf16 / fp16 conversion on the native SIMD kernels.

Rounding is to nearest, ties to even, bit-identical to ``array.astype(ml_dtypes.bfloat16)`` and
``array.astype(numpy.float16)`` for every input, including subnormals, signed zeros, infinities
and NaNs (bf16: every NaN becomes the sign-preserving canonical quiet NaN, as ml_dtypes does;
fp16: NaNs keep their top payload bits and are never turned into Inf, and values too large for
fp16 become +-Inf, as numpy does). Decompression is exact.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fastxfer import _core

_WIRE_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}
_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}


def _threads(threads: int | None) -> int:
    if threads is None:
        return 0  # the native default: FASTXFER_THREADS or the CPUs this process may use
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads must be an int or None, not {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return int(threads)


def _check_input(array, want: np.dtype, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, not {type(array).__name__}")
    if array.dtype != want:
        raise TypeError(f"{what} must have dtype {want.name}, not {array.dtype.name} (convert it explicitly; "
                        "fastxfer never makes a silent copy)")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous; pass numpy.ascontiguousarray({what})")
    return array


def _check_out(out, shape: tuple, want: np.dtype) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, not {type(out).__name__}")
    if out.dtype != want:
        raise TypeError(f"out must have dtype {want.name}, not {out.dtype.name}")
    if out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, expected {shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


def compress(array: np.ndarray, kind: str, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Round a float32 array to ``"bf16"`` (ml_dtypes.bfloat16) or ``"fp16"`` (numpy.float16).

    ``out``, if given, must be a C-contiguous writable array of the result dtype and the same
    shape; it is filled and returned. ``threads`` splits large arrays across that many threads
    (default: every CPU this process may run on). The GIL is released while converting.
    """
    if not isinstance(kind, str) or kind not in _ALIASES:
        raise ValueError(f"kind must be 'bf16' or 'fp16', not {kind!r}")
    kind = _ALIASES[kind]
    array = _check_input(array, np.dtype(np.float32), "array")
    nthreads = _threads(threads)
    want = _WIRE_DTYPES[kind]
    out = np.empty(array.shape, want) if out is None else _check_out(out, array.shape, want)
    _core.compress_into(array, out, kind, 1.0, nthreads)
    return out


def decompress(array: np.ndarray, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Widen a bfloat16 or float16 array back to float32 (exact)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array must be a numpy.ndarray, not {type(array).__name__}")
    if array.dtype == _WIRE_DTYPES["bf16"]:
        kind = "bf16"
    elif array.dtype == _WIRE_DTYPES["fp16"]:
        kind = "fp16"
    else:
        raise TypeError(f"array must have dtype bfloat16 or float16, not {array.dtype.name}")
    array = _check_input(array, array.dtype, "array")
    nthreads = _threads(threads)
    want = np.dtype(np.float32)
    out = np.empty(array.shape, want) if out is None else _check_out(out, array.shape, want)
    _core.decompress_into(array, out, kind, 1.0, nthreads)
    return out
