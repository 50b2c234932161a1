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
import os
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
submitted = 0  # collectives handed to the engine by this module so far (observability, tests)
_handle_ids = itertools.count(1)
_lock = threading.Lock()
_trace_names = itertools.count()


def _op_name(kind: str, name: str | None) -> str:
    """A name for an unnamed collective. In a traced function: a counter kept on that graph, so the
    names are fixed at trace time and identical on every rank that traces the same function, even
    if some rank traced other functions (or this one again) in between; eagerly: a process-wide
    counter, the same sequence on every rank that makes the same calls."""
    if name is not None:
        return name
    if tf.executing_eagerly():
        return f"tf.{kind}.{next(_trace_names)}"
    graph = tf.compat.v1.get_default_graph()
    n = getattr(graph, "_fastxfer_names", 0)
    setattr(graph, "_fastxfer_names", n + 1)
    return f"tf.graph.{kind}.{n}"


def _np_dtype(dtype: tf.DType):
    return dtype.as_numpy_dtype


def _aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: TensorFlow adopts such a
    buffer as a tensor without copying it (numpy's own large allocations are 16-byte aligned)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n].view(dtype).reshape(shape)


def _submit(kind, x: np.ndarray, name: str, op: str, compression: str, prescale: float, postscale: float,
            root: int, bucket_cap_mb=None) -> int:
    if kind == "allreduce":
        h = _fx.allreduce_async(x, op=op, compression=compression, name=name, prescale=prescale, postscale=postscale,
                                out=_aligned_empty(x.shape, x.dtype), bucket_cap_mb=bucket_cap_mb)
    elif kind == "broadcast":
        h = None
        result = _fx.broadcast(x, root=root, name=name)
    else:
        h = None
        result = _fx.allgather(x, name=name)
    global submitted
    with _lock:
        hid = next(_handle_ids)
        _handles[hid] = h if h is not None else result
        submitted += 1
    return hid


def _wait(hid: int) -> np.ndarray:
    with _lock:
        h = _handles.pop(int(hid))
    return h.wait() if isinstance(h, _fx.Handle) else h


def _wait_many(*hids):
    return [_wait(h) for h in hids]


def in_xla_context() -> bool:
    """True while tracing inside a function compiled with XLA (``jit_compile=True``)."""
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _graph_checks(what: str):
    """In graph mode: refuse XLA (a clear error instead of XLA's "unsupported op PyFunc") and
    return the graph whose collectives are chained into one fixed order."""
    if in_xla_context():
        raise FastxferError(
            f"{what}: fastxfer's collectives run on the host and cannot be compiled by XLA, and this function is "
            "being compiled with jit_compile=True. Compile only the computation (a jit_compile=True function for "
            "the forward/backward pass, called from a plain tf.function that reduces the gradients), or use "
            "jit_compile=False. (model.fit with fastxfer.keras.DistributedOptimizer turns XLA off for its "
            "training step by itself.)")
    return tf.compat.v1.get_default_graph()


_CHAIN = "_fastxfer_last_submit"


def _chained(graph, make_op):
    """Run `make_op()` under a control dependency on the graph's previous collective submit, so
    every collective of a traced function is issued in trace order on every rank (TensorFlow's
    executor would otherwise start independent ops in any order, and ranks must agree)."""
    last = getattr(graph, _CHAIN, None)
    with tf.control_dependencies([last] if last is not None else []):
        op = make_op()
    setattr(graph, _CHAIN, op)
    return op


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


def _grouped(tensors, names, op, compression, prescale, postscale, order=None, bucket_cap_mb=None, pin=False):
    """Graph mode: submit in `order` (default: list order), each as soon as its tensor exists but
    after the previous submit; one op waits for all results. `pin`: the tensors are gradients
    from a backward pass; make the backward pass wait for each submit (see _pin_to_backward)."""
    graph = _graph_checks("allreduce")
    order = range(len(tensors)) if order is None else order
    handles = [None] * len(tensors)
    before = getattr(graph, _CHAIN, None)
    for i in order:
        t, name = tensors[i], names[i]
        handles[i] = _chained(graph, lambda t=t, name=name: tf.numpy_function(
            lambda x, name=name: np.int64(_submit("allreduce", x, name, op, compression, prescale, postscale, 0,
                                                  bucket_cap_mb)),
            [t], tf.int64, stateful=True, name="fastxfer_submit"))
    if pin and _pin_enabled():
        _pin_to_backward(graph, [tensors[i] for i in order], [handles[i] for i in order], before)
    outs = tf.numpy_function(_wait_many, handles, [t.dtype for t in tensors], stateful=True, name="fastxfer_wait")
    outs = [outs] if not isinstance(outs, (list, tuple)) else list(outs)
    for r, t in zip(outs, tensors):
        r.set_shape(t.shape)
    return outs


def _pin_enabled() -> bool:
    """FASTXFER_TF_PIN: 1 always pin submits into the backward pass, 0 never, auto (default) when
    the engine has CPU time of its own -- this process may run on more CPUs than TensorFlow's
    intra-op threads use, or the engine thread is pinned to cores (FASTXFER_ENGINE_CPUS). With no
    spare core, an overlapped engine only time-slices with the backward pass on the same core and
    pinning costs time (measured: bench/RESULTS.md)."""
    mode = os.environ.get("FASTXFER_TF_PIN", "auto").strip().lower()
    if mode in ("1", "true", "yes", "on"):
        return True
    if mode in ("0", "false", "no", "off"):
        return False
    if mode != "auto":
        raise ValueError(f"FASTXFER_TF_PIN must be 1, 0 or auto, not {mode!r}")
    if os.environ.get("FASTXFER_ENGINE_CPUS"):
        return True
    cpus = len(os.sched_getaffinity(0))
    intra = tf.config.threading.get_intra_op_parallelism_threads() or cpus
    return cpus > intra


def _op_id(op) -> int:
    return op._id  # creation order within the graph  # noqa: SLF001


def _reaches(src, target, floor: int) -> bool:
    """Is `src` an ancestor of `target`? Searches target's ancestors with creation id >= floor
    (inputs are created before their consumers, so a path from src only passes ops created after
    src, except through control edges this module added, whose targets are all >= floor)."""
    stack, seen = [target], set()
    while stack:
        op = stack.pop()
        if op is src:
            return True
        for p in [t.op for t in op.inputs] + list(op.control_inputs):
            if p.graph is target.graph and _op_id(p) >= floor and p._id not in seen:  # noqa: SLF001
                seen.add(p._id)  # noqa: SLF001
                stack.append(p)
    return False


def _pin_to_backward(graph, grads, submits, before) -> None:
    """Overlap for real: TensorFlow's executor would let a ready submit wait behind the rest of the
    backward pass (its inter-op queues run the next layer's matmuls first). So each op that
    continues the backward pass from a gradient's inputs -- the other consumers of the tensors the
    gradient was computed from, e.g. the input-gradient matmul of the same layer -- gets a control
    edge from that gradient's submit: the backward pass goes on once the gradient is with the
    engine. An edge is added only where it cannot close a cycle: the consumer must not be an
    ancestor of the submit (whose ancestors are all earlier gradients and submits)."""
    floor = None  # lowest creation id among ops given an edge here
    for g, sub in zip(grads, submits):
        if g.graph is not graph:
            continue
        sop = sub.op
        for t in g.op.inputs:
            for c in t.consumers():
                if c is g.op or c.graph is not graph or c.type in ("PyFunc", "EagerPyFunc") \
                        or sop in c.control_inputs:
                    continue
                lo = _op_id(c) if floor is None else min(floor, _op_id(c))
                if _reaches(c, sop, lo):
                    continue
                c._add_control_input(sop)  # noqa: SLF001
                floor = lo


def grouped_allreduce(tensors, op=Average, compression=Compression.none, name=None, prescale_factor=1.0,
                      postscale_factor=1.0, names=None, order=None, bucket_cap_mb=None, _pin=False):
    """Reduce a list of tensors, fused by the engine. Submitted in list order, or in `order` (a
    permutation of the indexes, e.g. reversed for gradients, which a backward pass produces last
    layer first); `names` names each tensor (identical on every rank)."""
    op = _check_op(op, None)
    ts = [tf.convert_to_tensor(t) for t in tensors]
    if names is None:
        names = [_op_name("allreduce", None if name is None else f"{name}.{i}") for i in range(len(ts))]
    elif len(names) != len(ts):
        raise ValueError(f"{len(names)} names for {len(ts)} tensors")
    order = list(range(len(ts))) if order is None else list(order)
    if sorted(order) != list(range(len(ts))):
        raise ValueError("order must be a permutation of range(len(tensors))")
    if tf.executing_eagerly():
        hs = {i: _fx.allreduce_async(ts[i].numpy(), op=op, compression=compression, name=names[i],
                                     prescale=prescale_factor, postscale=postscale_factor,
                                     bucket_cap_mb=bucket_cap_mb) for i in order}
        return [tf.convert_to_tensor(hs[i].wait()) for i in range(len(ts))]
    return _grouped(ts, names, op, compression, prescale_factor, postscale_factor, order, bucket_cap_mb, pin=_pin)


def _single(kind, tensor, name, root=0):
    t = tf.convert_to_tensor(tensor)
    name = _op_name(kind, name)
    if tf.executing_eagerly():
        x = t.numpy()
        out = _fx.broadcast(x, root=root, name=name) if kind == "broadcast" else _fx.allgather(x, name=name)
        return tf.convert_to_tensor(out)
    graph = _graph_checks(kind)
    h = _chained(graph, lambda: tf.numpy_function(
        lambda x: np.int64(_submit(kind, x, name, "sum", "none", 1.0, 1.0, root)), [t], tf.int64, stateful=True,
        name=f"fastxfer_{kind}"))
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
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        reduced = reduce_gradients(flat, flat_sources, op=self._op, compression=self._compression,
                                   gradient_predivide_factor=self._predivide, prefix="DistributedGradientTape")
        return tf.nest.pack_sequence_as(grads, reduced)


def reduce_gradients(grads, variables, op=Average, compression=Compression.none, gradient_predivide_factor=1.0,
                     bucket_cap_mb=None, prefix="grad"):
    """Allreduce a list of gradients (one per variable) the way DistributedGradientTape and
    DistributedOptimizer do: submitted last variable first (the order a backward pass produces
    them), fused by the engine. A None gradient stays None and is not communicated (Keras then
    skips its variable, as it would in one process): every rank must have None for the same
    variables -- they do when every rank runs the same model code -- otherwise the ranks submit
    different requests and all of them raise MismatchError naming the gradient. IndexedSlices are
    made dense."""
    grads = list(grads)
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    op = _check_op(op, None)
    f = float(gradient_predivide_factor)
    if f <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, not {gradient_predivide_factor}")
    if compression not in (Compression.none, Compression.fp16, Compression.bf16):
        raise ValueError(f"compression must be Compression.none, .fp16 or .bf16, not {compression!r}")
    pre, post = (1.0 / f, f) if op == Average else (1.0, 1.0)
    dense, names, where = [], [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        dense.append(tf.convert_to_tensor(g))
        names.append(f"{prefix}.{i}.{_short_name(v)}")
        where.append(i)
    out = list(grads)
    if not dense:
        return out
    # compression applies to float32 gradients; others (float16/bfloat16 variables) travel as they are
    comps = [compression if d.dtype == tf.float32 else Compression.none for d in dense]
    order = list(reversed(range(len(dense))))
    for c in dict.fromkeys(comps):  # one group per wire format, each in backward order
        idx = [j for j in order if comps[j] == c]
        red = grouped_allreduce([dense[j] for j in idx], op=op, compression=c, prescale_factor=pre,
                                postscale_factor=post, names=[names[j] for j in idx], bucket_cap_mb=bucket_cap_mb,
                                _pin=True)
        for j, r in zip(idx, red):
            out[where[j]] = r
    return out


def _variable_dtype(v):
    d = getattr(v, "dtype", None)
    return tf.as_dtype(d) if d is not None else tf.float32


def _short_name(v) -> str:
    # the variable's own name without its layer path: layer names carry per-process counters
    # (dense_3) that can differ between ranks that built different throwaway models
    name = str(getattr(v, "name", "var")).split(":")[0]
    return name.rsplit("/", 1)[-1][-40:]


__all__ = ["Average", "Compression", "DistributedGradientTape", "in_xla_context", "reduce_gradients", "Max", "Min", "Sum", "allgather", "allreduce",
           "broadcast", "broadcast_object", "broadcast_variables", "grouped_allreduce", "init", "is_initialized",
           "local_rank", "local_size", "rank", "shutdown", "size"]
