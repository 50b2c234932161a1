"""The one seam between TensorFlow and the engine: ``submit`` a tensor's collective, ``wait`` for it.

Every collective on tensors (ops.py) goes through these two functions, eagerly and in a traced
function alike, and ``use_native()`` is the one place that chooses how:

- **native** (the default): fastxfer's asynchronous TensorFlow ops (native.py, csrc/tfops/) hand
  the tensor's buffer to the engine through its C interface -- no Python, no GIL, in place where
  TensorFlow forwards the buffer;
- **bridge** (the op library could not load, or ``FASTXFER_TF_NATIVE=0``): a pair of
  ``tf.numpy_function`` ops that call the numpy entry (fastxfer.comm.collectives.submit) with the
  same options -- the same bits, slower.

In a traced function each submit is chained after the graph's previous one (``chained``), so
every rank issues its collectives in trace order; TensorFlow's executor would otherwise start
independent ops in any order, and ranks must agree. Errors of an eager native op are raised as
fastxfer's own exception types (native.translate).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace

import numpy as np
import tensorflow as tf

import fastxfer as fx
from fastxfer.comm import collectives
from fastxfer.comm.options import CollectiveOptions
from fastxfer.tensorflow import native

_CHAIN = "_fastxfer_last_submit"  # graph attribute: the latest submit op of that graph
_GATHERING = ("allgather", "alltoall", "reducescatter")  # results sized by the engine, first dimension unknown


def use_native() -> bool:
    """Whether collectives on tensors use the native ops (True) or the numpy_function bridge."""
    return native.library() is not None


def in_xla_context() -> bool:
    """True while tracing inside a function compiled with XLA (``jit_compile=True``)."""
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _graph(what: str):
    """In graph mode: refuse XLA (a clear error instead of XLA's "unsupported op PyFunc") and
    return the graph whose collectives are chained into one fixed order."""
    if in_xla_context():
        raise fx.FastxferError(
            f"{what}: fastxfer's collectives run on the host and cannot be compiled by XLA, and this function is "
            "being compiled with jit_compile=True. Compile only the computation (a jit_compile=True function for "
            "the forward/backward pass, called from a plain tf.function that reduces the gradients), or use "
            "jit_compile=False. (model.fit with fastxfer.keras.DistributedOptimizer turns XLA off for its "
            "training step by itself.)")
    return tf.compat.v1.get_default_graph()


def chained(graph, make_op):
    """Run `make_op()` under a control dependency on the graph's previous collective submit, so
    every collective of a traced function is issued in trace order on every rank."""
    last = getattr(graph, _CHAIN, None)
    with tf.control_dependencies([last] if last is not None else []):
        op = make_op()
    setattr(graph, _CHAIN, op)
    return op


def _eager(fn):
    """Run native ops eagerly, raising fastxfer's own exceptions for the engine's errors."""
    try:
        return fn()
    except tf.errors.OpError as e:
        err = native.translate(e)
        if err is e:
            raise
        raise err from None


class Pending:
    """A submitted collective: what ``wait`` needs. ``handle`` is the submit op's output (graph
    mode: the op that overlap.py pins into the backward pass)."""

    __slots__ = ("kind", "tensor", "output", "handle")

    def __init__(self, kind, tensor, output, handle):
        self.kind, self.tensor, self.output, self.handle = kind, tensor, output, handle


# ---- the numpy_function bridge: handles of the numpy entry, by id ------------------------------

_lock = threading.Lock()
_handles: dict[int, collectives.Handle] = {}
_handle_ids = itertools.count(1)
_bridge_submitted = 0  # collectives the bridge handed to the engine so far


def submitted_count() -> int:
    """Collectives on tensors handed to the engine so far in this process, counted when they run
    (native ops and the bridge together): observability, tests."""
    return _bridge_submitted + native.submitted()


def _aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: TensorFlow adopts such a
    buffer as a tensor without copying it (numpy's own large allocations are 16-byte aligned)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n].view(dtype).reshape(shape)


def _bridge_submit(opts: CollectiveOptions, x: np.ndarray, splits=None) -> np.int64:
    global _bridge_submitted
    out = None if opts.kind in _GATHERING else _aligned_empty(x.shape, x.dtype)
    sp = () if splits is None or len(splits) == 0 else collectives.split_counts(splits)
    h = collectives.submit(opts, np.ascontiguousarray(x), out, splits=sp)
    with _lock:
        hid = next(_handle_ids)
        _handles[hid] = h
        _bridge_submitted += 1
    return np.int64(hid)


def _bridge_wait(hid):
    with _lock:
        h = _handles.pop(int(hid))
    try:
        got = h.wait()
    except (fx.MismatchError, ValueError) as e:
        # raised as the tf.errors class too (errors.py): tf.numpy_function gives an OpError's code
        # to the op's status, so a traced function fails with FailedPreconditionError, as natively
        from fastxfer.tensorflow import errors

        raise errors.translate(e) from None
    if isinstance(got, tuple):  # alltoall: (rows, received splits)
        return got[0], got[1].astype(np.int32)
    return got


# ---- the seam ----------------------------------------------------------------------------------


def submit(tensor: tf.Tensor, opts: CollectiveOptions, name: str, hold: bool = False, splits=None,
           group: int = 0) -> Pending:
    """Hand ``tensor``'s collective, described by ``opts`` (already checked for its dtype), to the
    engine under ``name``. ``hold``: more submits of the same group follow (native only: the engine
    negotiates the group in one round, docs/architecture.md "Grouped submits"). ``group``: an
    allreduce's fusion group (nonzero: never fused with another group's tensors; native only, the
    bridge fuses as the engine likes). ``splits``: an
    alltoall's int32 vector tensor (empty: an equal split)."""
    kind = opts.kind
    named = opts if opts.name == name else replace(opts, name=name)

    if use_native():
        def make():
            if kind == "alltoall":
                return native.submit_splits(tensor, splits, name, opts.set_id)
            return native.submit(tensor, kind, name, opts.op, opts.wire_for(tensor.dtype.as_numpy_dtype), opts.root,
                                 opts.prescale, opts.postscale, opts.bucket_cap, opts.set_id, hold=hold,
                                 group=group)
    else:
        def make():
            args = [tensor] if kind != "alltoall" else [tensor, splits]
            hid = tf.numpy_function(lambda x, sp=None: _bridge_submit(named, x, sp), args, tf.int64, stateful=True,
                                    name="fastxfer_submit")
            return None, hid

    if tf.executing_eagerly():
        out, h = _eager(make)
        return Pending(kind, tensor, out, h)
    pair = {}
    chained(_graph(kind), lambda: pair.setdefault("p", make())[1])
    out, h = pair["p"]
    return Pending(kind, tensor, out, h)


def wait(p: Pending):
    """The result of a submitted collective: a tensor (alltoall: (tensor, received splits int32)).
    allreduce and broadcast keep the input's shape; the gathering kinds' first dimension is
    known only when the engine has run."""
    t = p.tensor

    def run():
        if p.output is None:  # the bridge
            if p.kind == "alltoall":
                r, rs = tf.numpy_function(_bridge_wait, [p.handle], [t.dtype, tf.int32], stateful=True,
                                          name="fastxfer_wait")
                return _shaped(r, t), rs
            r = tf.numpy_function(_bridge_wait, [p.handle], t.dtype, stateful=True, name="fastxfer_wait")
            if p.kind in _GATHERING:
                return _shaped(r, t)
            r.set_shape(t.shape)
            return r
        if p.kind == "alltoall":
            r, rs = native.wait_alltoall(p.output, p.handle)
            return _shaped(r, t), rs
        if p.kind in _GATHERING:
            return _shaped(native.wait_gather(p.output, p.handle), t)
        return native.wait(p.output, p.handle)

    return _eager(run) if tf.executing_eagerly() else run()


def _shaped(r, t):
    """A gathered result has an unknown first dimension; the rest is the input's."""
    if t.shape.rank is not None and not tf.executing_eagerly():
        r.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return r


__all__ = ["Pending", "chained", "in_xla_context", "submit", "submitted_count", "use_native", "wait"]
