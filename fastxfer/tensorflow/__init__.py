"""Horovod-style TensorFlow API on fastxfer: collectives on tf.Tensors (eager and inside
tf.function), DistributedGradientTape and broadcast_variables.

Inside a tf.function each collective is a ``tf.numpy_function`` pair: a *submit* op that hands the
tensor to fastxfer's engine as soon as TensorFlow has produced it, and a *wait* op that returns
the result. The submits of one call are chained with control dependencies in a fixed order, so
every rank issues them in the same order (fastxfer's engine requires that; TensorFlow's executor
would otherwise run independent ops in any order), while the engine reduces early gradients
during the rest of the backward pass. These ops are not XLA-compilable: a function compiled with
jit_compile=True must keep them outside the compiled part.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import tensorflow as tf

import fastxfer as _fx
from fastxfer import (broadcast_object, init, is_initialized, local_rank, local_size, oob_allreduce as _np_oob,  # noqa: F401
                      rank, shutdown, size)
from fastxfer.errors import FastxferError, MismatchError, PeerFailureError  # noqa: F401

Average, Sum, Min, Max = "average", "sum", "min", "max"


class Compression:
    """Horovod's names for the wire formats of float32 gradients."""

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"


_handles: dict[int, object] = {}
_handle_ids = itertools.count(1)
_lock = threading.Lock()
_trace_names = itertools.count()


def _op_name(kind: str, name: str | None) -> str:
    # Graph mode: names are fixed when the function is traced, identically on every rank that
    # traces the same program; eager calls draw from the same sequence.
    return name if name is not None else f"tf.{kind}.{next(_trace_names)}"


def _np_dtype(dtype: tf.DType):
    return dtype.as_numpy_dtype


def _submit(kind, x: np.ndarray, name: str, op: str, compression: str, prescale: float, postscale: float,
            root: int) -> int:
    if kind == "allreduce":
        h = _fx.allreduce_async(x, op=op, compression=compression, name=name, prescale=prescale, postscale=postscale)
    elif kind == "broadcast":
        h = None
        result = _fx.broadcast(x, root=root, name=name)
    else:
        h = None
        result = _fx.allgather(x, name=name)
    with _lock:
        hid = next(_handle_ids)
        _handles[hid] = h if h is not None else result
    return hid


def _wait(hid: int) -> np.ndarray:
    with _lock:
        h = _handles.pop(int(hid))
    return h.wait() if isinstance(h, _fx.Handle) else h


def _check_op(op, average):
    if average is not None:  # Horovod's older keyword
        op = Average if average else Sum
    if op not in (Average, Sum, Min, Max):
        raise ValueError(f"op must be one of Average, Sum, Min, Max, not {op!r}")
    return op


def allreduce(tensor, average=None, op=Average, compression=Compression.none, name=None, prescale_factor=1.0,
              postscale_factor=1.0):
    """Reduce a tensor across all ranks (eager or inside tf.function); returns a tensor of the
    same shape and dtype."""
    op = _check_op(op, average)
    t = tf.convert_to_tensor(tensor)
    name = _op_name("allreduce", name)
    if tf.executing_eagerly():
        out = _fx.allreduce(t.numpy(), op=op, compression=compression, name=name, prescale=prescale_factor,
                            postscale=postscale_factor)
        return tf.convert_to_tensor(out)
    return _grouped([t], [name], op, compression, prescale_factor, postscale_factor)[0]


def _grouped(tensors, names, op, compression, prescale, postscale):
    """Graph mode: submit in list order (chained), then wait; returns the reduced tensors."""
    handles = []
    previous = None
    for t, name in zip(tensors, names):
        deps = [previous] if previous is not None else []
        with tf.control_dependencies(deps):
            h = tf.numpy_function(
                lambda x, name=name: np.int64(_submit("allreduce", x, name, op, compression, prescale, postscale, 0)),
                [t], tf.int64, stateful=True, name="fastxfer_submit")
        handles.append(h)
        previous = h
    outs = []
    for t, h in zip(tensors, handles):
        r = tf.numpy_function(_wait, [h], t.dtype, stateful=True, name="fastxfer_wait")
        r.set_shape(t.shape)
        outs.append(r)
    return outs


def grouped_allreduce(tensors, op=Average, compression=Compression.none, name=None, prescale_factor=1.0,
                      postscale_factor=1.0):
    """Reduce a list of tensors; fused by the engine, submitted in list order."""
    op = _check_op(op, None)
    ts = [tf.convert_to_tensor(t) for t in tensors]
    names = [_op_name("allreduce", None if name is None else f"{name}.{i}") for i in range(len(ts))]
    if tf.executing_eagerly():
        hs = [_fx.allreduce_async(t.numpy(), op=op, compression=compression, name=n, prescale=prescale_factor,
                                  postscale=postscale_factor) for t, n in zip(ts, names)]
        return [tf.convert_to_tensor(h.wait()) for h in hs]
    return _grouped(ts, names, op, compression, prescale_factor, postscale_factor)


def _single(kind, tensor, name, root=0):
    t = tf.convert_to_tensor(tensor)
    name = _op_name(kind, name)
    if tf.executing_eagerly():
        x = t.numpy()
        out = _fx.broadcast(x, root=root, name=name) if kind == "broadcast" else _fx.allgather(x, name=name)
        return tf.convert_to_tensor(out)
    h = tf.numpy_function(lambda x: np.int64(_submit(kind, x, name, "sum", "none", 1.0, 1.0, root)), [t], tf.int64,
                          stateful=True, name=f"fastxfer_{kind}")
    r = tf.numpy_function(_wait, [h], t.dtype, stateful=True, name="fastxfer_wait")
    if kind == "broadcast":
        r.set_shape(t.shape)
    else:
        r.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return r


def broadcast(tensor, root_rank=0, name=None):
    """Every rank gets root_rank's tensor."""
    return _single("broadcast", tensor, name, root_rank)


def allgather(tensor, name=None):
    """Concatenation of every rank's tensor along the first dimension (sizes may differ)."""
    return _single("allgather", tensor, name)


def broadcast_variables(variables, root_rank=0):
    """Assign root_rank's values to `variables` on every rank (tf.Variable or Keras 3 Variable)."""
    for i, v in enumerate(variables):
        value = v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v
        new = broadcast(tf.convert_to_tensor(value), root_rank, name=f"broadcast_variables.{i}")
        v.assign(new)


class DistributedGradientTape:
    """Wraps a tf.GradientTape: ``gradient()`` averages the gradients across ranks.

    Gradients are submitted in variable order (so every rank agrees), fused by the engine into
    buckets, and reduced while later gradients are still being submitted. ``None`` gradients
    stay None on every rank (the variable lists must match across ranks).
    """

    def __init__(self, tape: tf.GradientTape, compression=Compression.none, op=Average, gradient_predivide_factor=1.0):
        self._tape = tape
        self._compression = compression
        self._op = _check_op(op, None)
        self._predivide = float(gradient_predivide_factor)

    def __getattr__(self, item):
        return getattr(self._tape, item)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None, **kw):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kw)
        flat = tf.nest.flatten(grads)
        idx = [i for i, g in enumerate(flat) if g is not None]
        dense = [tf.convert_to_tensor(flat[i]) for i in idx]
        pre = 1.0 / self._predivide if self._op == Average else 1.0
        post = self._predivide if self._op == Average else 1.0
        reduced = grouped_allreduce(dense, op=self._op, compression=self._compression, name=None,
                                    prescale_factor=pre, postscale_factor=post) if dense else []
        for i, r in zip(idx, reduced):
            flat[i] = r
        return tf.nest.pack_sequence_as(grads, flat)


__all__ = ["Average", "Compression", "DistributedGradientTape", "Max", "Min", "Sum", "allgather", "allreduce",
           "broadcast", "broadcast_object", "broadcast_variables", "grouped_allreduce", "init", "is_initialized",
           "local_rank", "local_size", "rank", "shutdown", "size"]
