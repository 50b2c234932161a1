"""Argument checks shared by every entry point (numpy, TensorFlow, Keras, fusion, compression).

Each public function validates its arguments here, once, and passes plain values on: the native
module trusts what it is given. Errors name the argument and the fix: ``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong value, layout or size.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# dtypes the engine reduces, by the name the native core uses
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "uint16": np.dtype(np.uint16),
    "int16": np.dtype(np.int16),
    "bool": np.dtype(np.bool_),
}
OPS: tuple[str, ...] = ("sum", "average", "min", "max", "product")
COMPRESSIONS: tuple[str, ...] = ("none", "bf16", "fp16")
# what a compressed float32 value travels as
WIRE_DTYPES: dict[str, np.dtype] = {"bf16": DTYPES["bfloat16"], "fp16": DTYPES["float16"]}
_WIRE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
BUCKET_CAP_MB_RANGE = (1.0 / 1024, 4096.0)


def numpy_dtype(dtype) -> np.dtype:
    """The supported numpy dtype for a name or dtype-like; TypeError naming the supported ones."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES or DTYPES[dt.name] != dt:
        name = getattr(dt, "name", dtype)
        raise TypeError(f"unsupported dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return dt


_SUPPORTED = frozenset(DTYPES.values())


def array(x, what: str = "array") -> np.ndarray:
    """``x`` as a C-contiguous numpy array of a dtype the engine reduces."""
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - report what numpy said
            raise TypeError(f"{what} must be a numpy array or array-like: {e}") from None
    if a.dtype not in _SUPPORTED:  # a set lookup: numpy's dtype.name is slow Python (every call pays it)
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
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{what} must be C-contiguous and writable")
    return out


def op(value) -> str:
    """A reduction op name, lower-cased: sum, average, min, max or product."""
    if not isinstance(value, str) or value.lower() not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, not {value!r}")
    return value.lower()


def compression(value, dtype=None) -> str:
    """A wire compression name (None means 'none'); with ``dtype``, also checks it applies (float32)."""
    if value is None:
        value = "none"
    if not isinstance(value, str) or value not in COMPRESSIONS:
        raise ValueError(f"compression must be 'none', 'bf16' or 'fp16', not {value!r}")
    if value != "none" and dtype is not None and np.dtype(dtype) != np.float32:
        raise ValueError(f"compression={value!r} applies to float32 arrays; this one is {np.dtype(dtype).name}")
    return value


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
