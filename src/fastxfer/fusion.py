"""Fused gradient buckets: plan tensors into buckets, pack them (compressing) and unpack them
(decompressing and scaling), each in one pass over the data, on the native kernels.

The engine uses these to turn many small gradient tensors into a few large messages::

    planner = BucketPlanner(cap_bytes=25 << 20, compression="bf16")
    buckets = planner.plan(grads)                 # same list on every rank -> same buckets
    for b in buckets:
        wire = pack(b, [grads[i] for i in b.tensors])        # float32 -> bf16, one pass
        ...                                                 # reduce `wire` across ranks
        unpack(b, wire, [grads[i] for i in b.tensors], scale=1 / size)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastxfer import _core
from fastxfer import _validate as check
from fastxfer._validate import numpy_dtype  # public here too: the dtype of a bucket's dtype names

Bucket = _core.Bucket

DEFAULT_CAP_BYTES = 25 << 20
DEFAULT_FIRST_CAP_BYTES = 1 << 20


def _spec(t, i: int) -> tuple[int, str]:
    if isinstance(t, np.ndarray):
        return int(t.size), numpy_dtype(t.dtype).name
    try:
        shape, dtype = t
    except (TypeError, ValueError):
        raise TypeError(f"tensor {i}: expected a numpy array or a (shape, dtype) pair, got {t!r}") from None
    numel = int(np.prod(shape, dtype=np.int64)) if not isinstance(shape, (int, np.integer)) else int(shape)
    if numel < 0:
        raise ValueError(f"tensor {i}: negative size {shape!r}")
    return numel, numpy_dtype(dtype).name


class BucketPlanner:
    """Groups tensors, in gradient-ready order, into buckets of one dtype under a byte cap.

    Caps count bytes on the wire (after compression). The first bucket is capped lower so
    communication can start early in the backward pass. Planning depends on the tensor list
    alone, so ranks that see the same list plan the same buckets.
    """

    def __init__(self, cap_bytes: int = DEFAULT_CAP_BYTES, first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
                 compression: str = "none"):
        for name, v in (("cap_bytes", cap_bytes), ("first_cap_bytes", first_cap_bytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, not {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self._planner = _core.BucketPlanner(int(cap_bytes), int(first_cap_bytes), compression)

    @property
    def cap_bytes(self) -> int:
        return self._planner.cap_bytes

    @property
    def first_cap_bytes(self) -> int:
        return self._planner.first_cap_bytes

    @property
    def compression(self) -> str:
        return self._planner.compression

    def plan(self, tensors: Sequence) -> list[Bucket]:
        """``tensors``: numpy arrays or ``(shape, dtype)`` pairs, in the order they become ready."""
        return self._planner.plan([_spec(t, i) for i, t in enumerate(tensors)])


def pack(bucket: Bucket, tensors: Sequence[np.ndarray], out: np.ndarray | None = None, scale: float = 1.0,
         threads: int | None = None) -> np.ndarray:
    """Copy ``tensors`` (the bucket's, in its order) into one buffer of the bucket's wire dtype,
    multiplying float tensors by ``scale`` and compressing float32 on the way. Returns the buffer."""
    if out is None:
        out = np.empty(bucket.numel, numpy_dtype(bucket.wire_dtype))
    _core.pack(bucket, tensors, out, float(scale), check.threads(threads))
    return out


def unpack(bucket: Bucket, buffer: np.ndarray, outs: Sequence[np.ndarray] | None = None, scale: float = 1.0,
           threads: int | None = None) -> list[np.ndarray]:
    """Split a packed buffer back into tensors (flat arrays unless ``outs`` are given),
    decompressing and multiplying by ``scale`` on the way. Returns the output arrays."""
    if outs is None:
        dt = numpy_dtype(bucket.dtype)
        outs = [np.empty(n, dt) for n in bucket.numels]
    _core.unpack(bucket, buffer, outs, float(scale), check.threads(threads))
    return list(outs)


__all__ = ["Bucket", "BucketPlanner", "DEFAULT_CAP_BYTES", "DEFAULT_FIRST_CAP_BYTES", "numpy_dtype", "pack", "unpack"]
