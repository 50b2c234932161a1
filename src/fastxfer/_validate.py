"""Array and value checks shared by every entry point (numpy, TensorFlow, Keras, fusion, compression);
a collective's options (op, compression, scales, process set) are checked in comm/options.py.

Each public function validates its arguments here, once, and passes plain values on: the native
module trusts what it is given. Errors name the argument and the fix: ``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong value, layout or size.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping

import numpy as np


class _Dtypes(Mapping):
    """Name -> numpy dtype, with ml_dtypes' bfloat16 imported on first use. ml_dtypes takes about a
    second to import (registering its types with numpy), which `fastxfer run` and every worker that
    never sees a 16-bit brain float would pay at `import fastxfer`; an array of that dtype cannot
    exist before ml_dtypes is imported, so nothing is missed by waiting."""

    def __init__(self, names: dict[str, str]):
        self._names = names  # name -> numpy's name of the dtype (or "bfloat16")
        self._cache: dict[str, np.dtype] = {}

    def __getitem__(self, name: str) -> np.dtype:
        dt = self._cache.get(name)
        if dt is None:
            numpy_name = self._names[name]  # KeyError for an unknown name, as a dict
            if numpy_name == "bfloat16":
                import ml_dtypes

                dt = np.dtype(ml_dtypes.bfloat16)
            else:
                dt = np.dtype(numpy_name)
            self._cache[name] = dt
        return dt

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# dtypes the engine reduces, by the name the native core uses
DTYPES: Mapping[str, np.dtype] = _Dtypes({n: n for n in (
    "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "uint16", "int16", "bool")})
# what a compressed float32 value travels as
WIRE_DTYPES: Mapping[str, np.dtype] = _Dtypes({"bf16": "bfloat16", "fp16": "float16"})
_WIRE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
BUCKET_CAP_MB_RANGE = (1.0 / 1024, 4096.0)


def is_bfloat16(dt: np.dtype) -> bool:
    """Whether ``dt`` is ml_dtypes' bfloat16, without importing ml_dtypes (no such array exists before)."""
    return "ml_dtypes" in sys.modules and dt == DTYPES["bfloat16"]


def numpy_dtype(dtype) -> np.dtype:
    """The supported numpy dtype for a name or dtype-like; TypeError naming the supported ones."""
    try:
        dt = np.dtype(dtype)
    except TypeError:  # "bfloat16" is a name numpy learns when ml_dtypes is imported
        dt = DTYPES["bfloat16"] if isinstance(dtype, str) and dtype == "bfloat16" else None
    if dt is None or dt.name not in DTYPES or DTYPES[dt.name] != dt:
        name = getattr(dt, "name", dtype)
        raise TypeError(f"unsupported dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return dt


_SUPPORTED = frozenset(DTYPES[n] for n in DTYPES if n != "bfloat16")  # the one lazy dtype is checked apart


def array(x, what: str = "array") -> np.ndarray:
    """``x`` as a C-contiguous numpy array of a dtype the engine reduces."""
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - report what numpy said
            raise TypeError(f"{what} must be a numpy array or array-like: {e}") from None
    # a set lookup: numpy's dtype.name is slow Python (every call pays it)
    if a.dtype not in _SUPPORTED and not is_bfloat16(a.dtype):
        raise TypeError(f"{what} has dtype {a.dtype.name}; fastxfer moves {', '.join(DTYPES)}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def exact_array(x, want: np.dtype, what: str) -> np.ndarray:
    """``x`` itself, which must be a C-contiguous ndarray of dtype ``want`` (no silent copy)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, not {type(x).__name__}")
    if x.dtype != want:
        raise TypeError(f"{what} must have dtype {want.name}, not {x.dtype.name} (convert it explicitly; "
                        "fastxfer never makes a silent copy)")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous; pass numpy.ascontiguousarray({what})")
    return x


def out_array(out, shape: tuple, want: np.dtype, what: str = "out") -> np.ndarray:
    """An output buffer: a C-contiguous, writable ndarray of dtype ``want`` and shape ``shape``."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, not {type(out).__name__}")
    if out.dtype != want:
        raise TypeError(f"{what} must have dtype {want.name}, not {out.dtype.name}")
    if out.shape != tuple(shape):
        raise ValueError(f"{what} has shape {out.shape}, expected {tuple(shape)}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return out


def out_like(out, a: np.ndarray, what: str = "out") -> np.ndarray:
    """An output buffer for a collective on ``a``: a C-contiguous, writable ndarray of a's dtype and shape."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, not {type(out).__name__}")
    if out.dtype != a.dtype or out.shape != a.shape:
        raise ValueError(f"{what} must be {a.dtype.name}{list(a.shape)}, not {out.dtype.name}{list(out.shape)}")
    flags = out.flags  # a new object at every read of .flags
    if not flags.c_contiguous or not flags.writeable:
        raise ValueError(f"{what} must be C-contiguous and writable")
    # the engine reads the input and writes the output chunk by chunk, in different orders: the
    # same buffer (in place) is fine, a buffer that overlaps it elsewhere would read results
    # (both C-contiguous: sharing memory is overlapping address ranges, what may_share_memory's
    # bounds check sees; .ctypes is slow, so it is only read when the ranges do overlap)
    if a.size and out is not a and np.may_share_memory(out, a) and out.ctypes.data != a.ctypes.data:
        raise ValueError(f"{what} overlaps the input array without being it: pass {what}=the input itself to reduce "
                         f"in place, or a separate array")
    return out


def wire_kind(kind) -> str:
    """'bf16' or 'fp16' (also accepts 'bfloat16' and 'float16')."""
    if not isinstance(kind, str) or kind not in _WIRE_ALIASES:
        raise ValueError(f"kind must be 'bf16' or 'fp16', not {kind!r}")
    return _WIRE_ALIASES[kind]


def bucket_cap_bytes(mb) -> int:
    """A per-request fusion bucket cap in bytes from megabytes; None means the engine's default (0)."""
    if mb is None:
        return 0
    lo, hi = BUCKET_CAP_MB_RANGE
    if isinstance(mb, bool) or not isinstance(mb, (int, float, np.integer, np.floating)) or not lo <= mb <= hi:
        raise ValueError(f"bucket_cap_mb must be a number between 1/1024 and 4096, not {mb!r}")
    return int(mb * (1 << 20))


def threads(value) -> int:
    """A thread count for the native kernels (None: the native default, 0)."""
    if value is None:
        return 0  # the native default: FASTXFER_THREADS or the CPUs this process may use
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"threads must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"threads must be >= 1, got {value}")
    return int(value)
