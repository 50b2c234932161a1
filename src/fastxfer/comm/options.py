"""What one collective call asks for, checked once: ``CollectiveOptions``.

Every public collective -- numpy (fastxfer.comm.collectives), TensorFlow (fastxfer.tensorflow.api),
Keras, the gradient tape and DistributedOptimizer -- turns its arguments into one immutable
``CollectiveOptions`` at its entry, through the constructors here (``allreduce``, ``broadcast``,
``reducescatter``, ``gather``), and passes that object down unchanged. This module is the only
place the op, the compression, the scale factors, the bucket cap (through _validate, shared with init), the process set
and the root are validated; below it nothing checks or converts them again. The engine receives the fields as they
are (csrc/engine/request_builder.h): an average's 1/size is applied there, by the engine that runs
the request.

Errors name the argument and the fix: ``TypeError`` for a wrong type, ``ValueError`` for a wrong
value (``ProcessSetRemovedError`` for a removed process set), ``NotInProcessSetError`` (a
FastxferError) for a process set this rank is not in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fastxfer import _validate
from fastxfer.comm import group, process_sets

OPS: tuple[str, ...] = ("sum", "average", "min", "max", "product", "adasum")
COMPRESSIONS: tuple[str, ...] = ("none", "bf16", "fp16")
# the numpy dtype a compressed float32 value travels as
WIRE_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class CollectiveOptions:
    """A collective's validated options. Immutable: build one with the constructors of this module.

    ``compression`` is the wire format asked for float32 data; ``compressor`` a user compressor
    (an object with Horovod's ``compress``/``decompress``, TensorFlow only) that runs around an
    uncompressed reduction. ``postscale`` is the caller's: the engine multiplies an average's by
    1/size when it makes the request. ``root`` is the broadcast root as the engine numbers it (its
    position in the process set's ranks); ``root_rank`` the rank of the job the caller named.
    ``process_set`` is the registered set (None: every rank)."""

    kind: str
    op: str = "sum"
    compression: str = "none"
    compressor: object = None
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: process_sets.ProcessSet | None = None
    root: int = 0
    root_rank: int = 0
    bucket_cap: int = 0
    name: str | None = None

    @property
    def set_id(self) -> int:
        """The process set's id as the engine and the TensorFlow ops know it (0: every rank)."""
        return 0 if self.process_set is None else self.process_set.process_set_id

    @property
    def ranks(self) -> list[int] | None:
        """The ranks taking part (None: every rank of the job)."""
        return None if self.process_set is None else self.process_set.ranks

    @property
    def size(self) -> int:
        """How many ranks take part."""
        return group.size() if self.process_set is None else len(self.process_set.ranks)

    def wire_for(self, dtype) -> str:
        """The wire format for data of ``dtype``: the compression for float32, else "none" (other
        dtypes travel as they are, as Horovod's compressors leave non-float tensors alone)."""
        return self.compression if np.dtype(dtype) == np.float32 else "none"

    def check_dtype(self, dtype, strict_compression: bool = True) -> None:
        """Whether these options apply to data of ``dtype``. ``strict_compression``: compression on
        anything but float32 is an error (the numpy API); otherwise such data travels uncompressed
        (TensorFlow, as Horovod)."""
        dtype = np.dtype(dtype)
        if strict_compression and self.compression != "none" and dtype != np.float32:
            raise ValueError(f"compression={self.compression!r} applies to float32 arrays; this one is {dtype.name}")
        if self.kind not in ("allreduce", "reducescatter"):
            return
        if self.op == "adasum" and dtype.kind != "f" and not _validate.is_bfloat16(dtype):
            raise TypeError(f"op='adasum' combines floating-point data (float16, bfloat16, float32, float64), "
                            f"not {dtype.name}")
        if dtype.kind == "b":
            # bool has no average: sum/max are a logical or, min/product a logical and
            if self.op == "average":
                raise TypeError("op='average' needs a numeric dtype, not bool: sum is a logical or, min a logical and")
            if self.prescale != 1.0 or self.postscale != 1.0:
                raise TypeError("bool arrays cannot be scaled (prescale/postscale must be 1)")
        # Everything else scales as Horovod's ScaleBuffer does (docs/algorithms.md, "Scaling"):
        # integers in float64, truncated toward zero (an integer average is the wrapped sum times
        # 1/size, likewise); float16 and bfloat16 in float32, rounded once.


# ---- the checks, each in one place -------------------------------------------------------------


def check_op(value) -> str:
    """A reduction op name, lower-cased: sum, average, min, max or product."""
    if not isinstance(value, str) or value.lower() not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, not {value!r}")
    return value.lower()


def check_compression(value, compressors: bool) -> tuple[str, object]:
    """(wire format, user compressor or None) for a ``compression=`` argument: None, a wire-format
    name (``"none"``, ``"bf16"``, ``"fp16"``, or a built-in compressor, which is that name as a str),
    or -- where ``compressors`` -- an object or class with ``compress`` and ``decompress``."""
    if value is None:
        return "none", None
    if isinstance(value, str):
        if value not in COMPRESSIONS:
            raise ValueError(f"compression must be 'none', 'bf16' or 'fp16'"
                             f"{' (Compression.none, .bf16, .fp16) or a compressor' if compressors else ''}, "
                             f"not {value!r}")
        return str(value), None
    if compressors and callable(getattr(value, "compress", None)) and callable(getattr(value, "decompress", None)):
        return "none", value
    if compressors:
        raise ValueError(f"compression must be Compression.none, .bf16, .fp16 or an object with compress(tensor) -> "
                         f"(tensor, ctx) and decompress(tensor, ctx), not {value!r}")
    raise ValueError(f"compression must be 'none', 'bf16' or 'fp16', not {value!r}")


def check_scale(what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def check_name(name) -> str | None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    return name


def root_index(root, ranks) -> int:
    """A broadcast's root (a rank of the job) as the engine numbers it: its position in the
    process set's ``ranks`` (None: every rank, the rank itself). ValueError when it is not one."""
    size = group.size()
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}, not {root!r}")
    if ranks is None:
        return int(root)
    if int(root) not in ranks:
        raise ValueError(f"root rank {root} is not in the process set (ranks {ranks})")
    return ranks.index(int(root))


# ---- constructors: one per kind of call ---------------------------------------------------------


def allreduce(op="average", compression="none", prescale=1.0, postscale=1.0, bucket_cap_mb=None, process_set=None,
              name=None, compressors: bool = False, members_only: bool = True) -> CollectiveOptions:
    """Options of an allreduce (``compressors``: a user compressor object is allowed, TensorFlow;
    ``not members_only``: a process set this rank is not in is allowed -- a gradient reduction,
    which then leaves this rank's gradients alone, as Horovod does)."""
    ps = process_sets.resolve(process_set, members_only)
    wire, user = check_compression(compression, compressors)
    return CollectiveOptions("allreduce", check_op(op), wire, user, check_scale("prescale", prescale),
                             check_scale("postscale", postscale), ps, bucket_cap=_validate.bucket_cap_bytes(bucket_cap_mb),
                             name=check_name(name))


def reducescatter(op="average", compression="none", prescale=1.0, postscale=1.0, process_set=None, name=None,
                  compressors: bool = False) -> CollectiveOptions:
    """Options of a reducescatter: op sum or average."""
    ps = process_sets.resolve(process_set)
    op = check_op(op)
    if op not in ("sum", "average"):
        raise ValueError(f"reducescatter takes op 'sum' or 'average', not {op!r}")
    wire, user = check_compression(compression, compressors)
    return CollectiveOptions("reducescatter", op, wire, user, check_scale("prescale", prescale),
                             check_scale("postscale", postscale), ps, name=check_name(name))


def broadcast(root=0, process_set=None, name=None) -> CollectiveOptions:
    """Options of a broadcast from ``root``, a rank of the job (in a process set: one of its ranks)."""
    ps = process_sets.resolve(process_set)
    index = root_index(root, None if ps is None else ps.ranks)
    return CollectiveOptions("broadcast", process_set=ps, root=index, root_rank=int(root), name=check_name(name))


def gather(kind: str, process_set=None, name=None) -> CollectiveOptions:
    """Options of a collective with no reduction: allgather, alltoall, barrier, join."""
    if kind not in ("allgather", "alltoall", "barrier", "join"):
        raise ValueError(f"unknown collective {kind!r}")
    return CollectiveOptions(kind, process_set=process_sets.resolve(process_set), name=check_name(name))


__all__ = ["COMPRESSIONS", "CollectiveOptions", "OPS", "WIRE_DTYPE_NAMES", "allreduce",
           "broadcast", "check_compression", "check_name", "check_op", "check_scale", "gather",
           "reducescatter", "root_index"]
