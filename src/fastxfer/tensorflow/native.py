"""fastxfer's native TensorFlow ops (csrc/tfops/, the ``_tfops`` library beside ``_core``).

``library()`` loads them once with ``tf.load_op_library`` and connects them to the engine; when
they cannot load (a build without them, a TensorFlow whose C API lacks a function they need),
it warns once, with the reason, and returns None: fastxfer.tensorflow then uses its
``tf.numpy_function`` bridge, which gives bit-identical results, only slower.
``FASTXFER_TF_NATIVE=0`` chooses that bridge on purpose (comparisons, debugging).

The ops (design: docs/tensorflow.md):

- ``submit(tensor, ...) -> (output, handle)`` hands the tensor to the engine and returns at once;
  ``output`` is the tensor's own buffer when TensorFlow can forward it (in place), else a new one.
- ``wait(output, handle) -> result`` completes when the engine has reduced that tensor.
- ``wait_gather(tensor, handle) -> result`` the same for allgather and reducescatter (result
  allocated at the end).
- ``submit_splits(tensor, splits, name)`` / ``wait_alltoall(output, handle) -> (result, splits)``:
  alltoall, whose splits are a tensor read when the op runs.
"""

from __future__ import annotations

import os
import struct
import threading

import tensorflow as tf

from fastxfer import _core, settings
from fastxfer.log import logger

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_tfops.so")

# the engine's codes (csrc/common/request.h, dtype.h): the op's attributes carry these
OP_CODES = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4, "adasum": 5}
COMPRESSION_CODES = {"none": 0, "bf16": 1, "fp16": 2}

_lock = threading.Lock()
_lib = None
_tried = False
_reason: str | None = None


def enabled_by_env() -> bool:
    """FASTXFER_TF_NATIVE (fastxfer.settings): False chooses the tf.numpy_function bridge."""
    return settings.get("FASTXFER_TF_NATIVE")


def library():
    """The loaded op library, or None when the tf.numpy_function bridge must be used."""
    global _lib, _tried, _reason
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if not enabled_by_env():
            _reason = "FASTXFER_TF_NATIVE=0"
        else:
            try:
                if not os.path.exists(PATH):
                    raise FileNotFoundError(f"{PATH} is missing (fastxfer was built without its TensorFlow ops)")
                lib = tf.load_op_library(PATH)
                if not hasattr(lib, "fastxfer_submit"):
                    raise RuntimeError("the library registered no ops")
                _core.connect_op_library(PATH)
                _lib = lib
            except Exception as e:  # any reason at all: fall back, loudly, once
                _reason = f"{type(e).__name__}: {e}"
                logger.warning("the native TensorFlow ops could not be loaded (%s); collectives on tensors fall "
                               "back to the slower tf.numpy_function bridge", _reason)
        _tried = True
        return _lib


def reason() -> str | None:
    """Why the native ops are not in use (None when they are, or have not been tried yet)."""
    return _reason


_cdll = None


def _c():
    """The loaded library's C entry points (the copy TensorFlow loaded: same path, opened once)."""
    global _cdll
    if _cdll is None:
        import ctypes

        _cdll = ctypes.CDLL(PATH)
    return _cdll


def pending() -> int:
    """Collectives submitted through the native ops and not yet waited for (this process)."""
    return int(_c().fastxfer_tfops_pending()) if _lib is not None else 0


def submitted() -> int:
    """Collectives the native ops have handed to the engine in this process (read at run time)."""
    return int(_c().fastxfer_tfops_submitted()) if _lib is not None else 0


def buffers() -> dict:
    """How many allreduce/broadcast submits so far reduced in place (TensorFlow forwarded the
    tensor's buffer) and how many needed a buffer of their own (and its bytes), in this process."""
    import ctypes

    if _lib is None:
        return {"in_place": 0, "allocated": 0, "allocated_bytes": 0}
    f, a, b = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    _c().fastxfer_tfops_buffers(ctypes.byref(f), ctypes.byref(a), ctypes.byref(b))
    return {"in_place": f.value, "allocated": a.value, "allocated_bytes": b.value}


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def submit(tensor, kind: str, name: str, op: str = "sum", compression: str = "none", root: int = 0,
           prescale: float = 1.0, postscale: float = 1.0, bucket_cap: int = 0, process_set: int = 0,
           hold: bool = False, group: int = 0):
    """The submit op on ``tensor``: returns (output, handle). Options are already validated;
    ``root`` is the engine's (the position in the process set), ``process_set`` an id (0: every rank).
    ``hold``: more submits of the same group follow; the engine starts no round for this one until
    a submit without ``hold`` (docs/architecture.md, "Grouped submits"). ``group``: the allreduce's
    fusion group (0: none); tensors of different groups never share a bucket."""
    return _lib.fastxfer_submit(tensor, kind=kind, tensor_name=name, reduce_op=OP_CODES[op],
                                compression=COMPRESSION_CODES[compression], root=int(root),
                                prescale_bits=_bits(prescale), postscale_bits=_bits(postscale),
                                bucket_cap=int(bucket_cap), process_set=int(process_set), hold=int(bool(hold)),
                                group=int(group), name="fastxfer_submit")


def submit_splits(tensor, splits, name: str, process_set: int = 0):
    """The alltoall submit op: ``splits`` is an int32/int64 vector tensor (empty: an equal split),
    read when the op runs."""
    return _lib.fastxfer_submit_splits(tensor, splits, kind="alltoall", tensor_name=name,
                                       process_set=int(process_set), name="fastxfer_submit")


def wait_alltoall(output, handle):
    """(received, received_splits int32) of an alltoall submit."""
    return _lib.fastxfer_wait_alltoall(output, handle, name="fastxfer_wait")


def wait(output, handle):
    return _lib.fastxfer_wait(output, handle, name="fastxfer_wait")


def wait_gather(output, handle):
    return _lib.fastxfer_wait_gather(output, handle, name="fastxfer_wait")


def is_submit(t) -> bool:
    """Whether ``t`` is the handle output of a native submit op (graph mode)."""
    return getattr(getattr(t, "op", None), "type", None) in ("FastxferSubmit", "FastxferSubmitSplits")


def translate(e: tf.errors.OpError) -> Exception:
    """fastxfer's exception for an error raised by a native op (eagerly), else ``e`` itself
    (fastxfer.tensorflow.errors)."""
    from fastxfer.tensorflow import errors

    return errors.translate(e)
