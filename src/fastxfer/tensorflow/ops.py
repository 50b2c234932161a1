"""Collectives on tf.Tensors, eager and inside tf.function: Horovod's op and compression names,
allreduce, grouped_allreduce, broadcast, allgather, alltoall, reducescatter, grouped_reducescatter,
oob_allreduce.

Each collective is a pair of ops: a *submit* op that hands the tensor to fastxfer's engine as
soon as TensorFlow has produced it, and a *wait* op that returns the result. They are fastxfer's
native TensorFlow ops (``native``: C++, asynchronous, in place, no Python per tensor) -- eagerly
and inside tf.function -- or, when those cannot load, a ``tf.numpy_function`` pair that gives the
same bits, slower. The submits of one traced function are chained with control dependencies in trace
order (``chained``), so every rank issues them in the same order (fastxfer's engine requires
that; TensorFlow's executor would otherwise run independent ops in any order), while the engine
reduces early gradients during the rest of the backward pass. These ops are not XLA-compilable:
a function compiled with jit_compile=True must keep them outside the compiled part.
"""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import tensorflow as tf

import fastxfer as fx
from fastxfer import _validate
from fastxfer.comm import process_sets
from fastxfer.comm.collectives import allreduce_settings, root_index
from fastxfer.tensorflow import native

Average, Sum, Min, Max, Product = "average", "sum", "min", "max", "product"


class Compression:
    """Horovod's names for the wire formats of float32 gradients."""

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"


_handles: dict[int, object] = {}
_bridge_submitted = 0  # collectives the tf.numpy_function bridge handed to the engine so far


def submitted_count() -> int:
    """Collectives on tensors handed to the engine so far in this process, counted when they run
    (native ops and the numpy_function bridge together): observability, tests."""
    return _bridge_submitted + native.submitted()
_handle_ids = itertools.count(1)
_lock = threading.Lock()
_trace_names = itertools.count()
_set_names: dict[int, itertools.count] = {}
_CHAIN = "_fastxfer_last_submit"  # graph attribute: the latest submit op of that graph


@fx.comm.group.on_shutdown
def _forget_names() -> None:
    # eager names are per job: after a shutdown (an elastic reset, say) every rank, old or new,
    # numbers them from 0 again
    global _trace_names
    with _lock:
        _trace_names = itertools.count()
        _set_names.clear()


def check_op(op, average=None) -> str:
    """The reduction op name (Average, Sum, Min, Max or Product); ``average`` is Horovod's older keyword
    (True: Average, False: Sum) and wins when given."""
    if average is not None:
        op = Average if average else Sum
    return _validate.op(op)


class _Set:
    """A collective's process set as the ops need it: the set (None: every rank), its id, size, ranks."""

    __slots__ = ("ps", "id", "size", "ranks")

    def __init__(self, process_set=None):
        self.ps = process_sets.resolve(process_set)
        self.id = 0 if self.ps is None else self.ps.process_set_id
        self.ranks = None if self.ps is None else self.ps.ranks
        self.size = fx.size() if self.ps is None else len(self.ranks)


def _op_name(kind: str, name: str | None, pid: int = 0) -> str:
    """A name for an unnamed collective. In a traced function: a counter kept on that graph, so the
    names are fixed at trace time and identical on every rank that traces the same function, even
    if some rank traced other functions (or this one again) in between; eagerly: a process-wide
    counter, the same sequence on every rank that makes the same calls."""
    if name is not None:
        return name
    if pid:
        kind = f"{kind}.set{pid}"  # only the set's ranks call its collectives: numbered apart
    if tf.executing_eagerly():
        if pid:
            with _lock:
                c = _set_names.setdefault(pid, itertools.count())
            return f"tf.{kind}.{next(c)}"
        return f"tf.{kind}.{next(_trace_names)}"
    graph = tf.compat.v1.get_default_graph()
    n = getattr(graph, "_fastxfer_names", 0)
    setattr(graph, "_fastxfer_names", n + 1)
    return f"tf.graph.{kind}.{n}"


def _aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: TensorFlow adopts such a
    buffer as a tensor without copying it (numpy's own large allocations are 16-byte aligned)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n].view(dtype).reshape(shape)


def _submit(kind, x: np.ndarray, name: str, op: str, compression: str, prescale: float, postscale: float,
            root: int, bucket_cap_mb=None, ps=None) -> int:
    """Body of a submit op: hand `x` to the engine, return the id its wait op looks up. ``root``:
    a rank of the job."""
    if kind == "allreduce":
        h = fx.allreduce_async(x, op=op, compression=compression, name=name, prescale=prescale, postscale=postscale,
                               out=_aligned_empty(x.shape, x.dtype), bucket_cap_mb=bucket_cap_mb, process_set=ps)
    elif kind == "broadcast":
        h = None
        result = fx.broadcast(x, root=root, name=name, process_set=ps)
    else:
        h = None
        result = fx.allgather(x, name=name, process_set=ps)
    global _bridge_submitted
    with _lock:
        hid = next(_handle_ids)
        _handles[hid] = h if h is not None else result
        _bridge_submitted += 1
    return hid


def _wait(hid: int) -> np.ndarray:
    with _lock:
        h = _handles.pop(int(hid))
    return h.wait() if isinstance(h, fx.Handle) else h


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
        raise fx.FastxferError(
            f"{what}: fastxfer's collectives run on the host and cannot be compiled by XLA, and this function is "
            "being compiled with jit_compile=True. Compile only the computation (a jit_compile=True function for "
            "the forward/backward pass, called from a plain tf.function that reduces the gradients), or use "
            "jit_compile=False. (model.fit with fastxfer.keras.DistributedOptimizer turns XLA off for its "
            "training step by itself.)")
    return tf.compat.v1.get_default_graph()


def chained(graph, make_op):
    """Run `make_op()` under a control dependency on the graph's previous collective submit, so
    every collective of a traced function is issued in trace order on every rank (TensorFlow's
    executor would otherwise start independent ops in any order, and ranks must agree)."""
    last = getattr(graph, _CHAIN, None)
    with tf.control_dependencies([last] if last is not None else []):
        op = make_op()
    setattr(graph, _CHAIN, op)
    return op


def allreduce(tensor, average=None, op=Average, compression=Compression.none, name=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Reduce a tensor across all ranks (eager or inside tf.function); returns a tensor of the
    same shape and dtype. ``process_set``: a registered ProcessSet (None: every rank)."""
    op = check_op(op, average)
    compression = _validate.compression(compression)
    t = tf.convert_to_tensor(tensor)
    s = _Set(process_set)
    name = _op_name("allreduce", name, s.id)
    if tf.executing_eagerly():
        if native.library() is not None:
            return _eager_grouped([t], [name], op, compression, prescale_factor, postscale_factor, [0], None, s)[0]
        out = fx.allreduce(t.numpy(), op=op, compression=compression, name=name, prescale=prescale_factor,
                           postscale=postscale_factor, process_set=s.ps)
        return tf.convert_to_tensor(out)
    return wait_grouped(submit_grouped([t], [name], op, compression, prescale_factor, postscale_factor,
                                       process_set=s.ps), [t])[0]


def _np_dtype(t) -> np.dtype:
    return np.dtype(t.dtype.as_numpy_dtype)


def _eager(fn):
    """Run native ops eagerly, raising fastxfer's own exceptions for the engine's errors."""
    try:
        return fn()
    except tf.errors.OpError as e:
        err = native.translate(e)
        if err is e:
            raise
        raise err from None


HOLD_BYTES = 1 << 20  # a held run of submits ends once it holds this much (or the bucket cap, if less)


def held(tensors, order, settings) -> set:
    """The indexes of a grouped allreduce whose submits may hold (``native.submit``): in
    submission order, runs of tensors up to ``HOLD_BYTES`` on the wire (or the bucket cap, if
    smaller), every one held but the last of its run, and never the last of the group. The engine
    then negotiates a run of small gradients in one round when its last tensor arrives, instead of
    starting a round at the first and one more for each tensor that arrives while it runs
    (measured: a round per tensor for a model of ten small tensors). Past about a MiB a round's
    fixed cost is small against the reduction, and holding longer only delays it (ResNet-50 was
    slower held to whole 25 MiB buckets): docs/architecture.md, "Grouped submits". A tensor of
    unknown size ends a run. FASTXFER_TF_HOLD=0 holds none (read when the graph is traced)."""
    if os.environ.get("FASTXFER_TF_HOLD", "1") == "0":
        return set()
    order = list(order)
    default_cap = fx.comm.group.settings().get("cap", 25 << 20)
    hold, filled = set(), 0
    for k, i in enumerate(order):
        t = tensors[i]
        _, c, _, _, cap = settings[i]
        n = t.shape.num_elements()
        if k == len(order) - 1 or n is None:
            filled = 0
            continue
        filled += n * (2 if c in ("bf16", "fp16") else t.dtype.size)
        if filled >= min(cap or default_cap, HOLD_BYTES):
            filled = 0
            continue
        hold.add(i)
    return hold


def _eager_grouped(ts, names, op, compression, prescale, postscale, order, bucket_cap_mb, s) -> list:
    """Native ops, eagerly: every submit in `order`, then every wait."""
    settings = [allreduce_settings(_np_dtype(t), op, compression, prescale, postscale, bucket_cap_mb, s.size,
                                   divide=False) for t in ts]
    holds = held(ts, order, settings)

    def run():
        subs = {}
        for i in order:
            o, c, pre, post, cap = settings[i]
            subs[i] = native.submit(ts[i], "allreduce", names[i], o, c, 0, pre, post, cap, s.id, hold=i in holds)
        return [native.wait(*subs[i]) for i in range(len(ts))]

    return _eager(run)


def submit_grouped(tensors, names, op, compression, prescale, postscale, order=None, bucket_cap_mb=None,
                   process_set=None) -> list:
    """Graph mode: one submit op per tensor, in `order` (default: list order), each running as
    soon as its tensor exists but after the graph's previous submit. Returns the submit ops'
    outputs (handle ids) by tensor index, for ``wait_grouped``."""
    graph = _graph_checks("allreduce")
    s = _Set(process_set)
    order = range(len(tensors)) if order is None else order
    handles = [None] * len(tensors)
    if native.library() is not None:
        settings = [allreduce_settings(_np_dtype(t), op, compression, prescale, postscale, bucket_cap_mb, s.size,
                                       divide=False) for t in tensors]
        holds = held(tensors, order, settings)
        for i in order:
            o, c, pre, post, cap = settings[i]
            handles[i] = chained(graph, lambda t=tensors[i], name=names[i], o=o, c=c, pre=pre, post=post, cap=cap,
                                 h=i in holds: native.submit(t, "allreduce", name, o, c, 0, pre, post, cap, s.id,
                                                             hold=h)[1])
        return handles
    for i in order:
        t, name = tensors[i], names[i]
        handles[i] = chained(graph, lambda t=t, name=name: tf.numpy_function(
            lambda x, name=name: np.int64(_submit("allreduce", x, name, op, compression, prescale, postscale, 0,
                                                  bucket_cap_mb, s.ps)),
            [t], tf.int64, stateful=True, name="fastxfer_submit"))
    return handles


def wait_grouped(handles, tensors) -> list:
    """Graph mode: waits for every handle of ``submit_grouped``; returns the results, each with the
    shape and dtype of its input tensor. Native: one asynchronous wait op per tensor, so whatever
    uses a result (the optimizer's update of that variable) can run as soon as it is reduced."""
    if handles and native.is_submit(handles[0]):
        return [native.wait(h.op.outputs[0], h) for h in handles]
    outs = tf.numpy_function(_wait_many, handles, [t.dtype for t in tensors], stateful=True, name="fastxfer_wait")
    outs = [outs] if not isinstance(outs, (list, tuple)) else list(outs)
    for r, t in zip(outs, tensors):
        r.set_shape(t.shape)
    return outs


def grouped_allreduce(tensors, op=Average, compression=Compression.none, name=None, prescale_factor=1.0,
                      postscale_factor=1.0, names=None, order=None, bucket_cap_mb=None, process_set=None):
    """Reduce a list of tensors, fused by the engine. Submitted in list order, or in `order` (a
    permutation of the indexes, e.g. reversed for gradients, which a backward pass produces last
    layer first); `names` names each tensor (identical on every rank)."""
    op = check_op(op)
    compression = _validate.compression(compression)
    ts = [tf.convert_to_tensor(t) for t in tensors]
    s = _Set(process_set)
    if names is None:
        names = [_op_name("allreduce", None if name is None else f"{name}.{i}", s.id) for i in range(len(ts))]
    elif len(names) != len(ts):
        raise ValueError(f"{len(names)} names for {len(ts)} tensors")
    order = list(range(len(ts))) if order is None else list(order)
    if sorted(order) != list(range(len(ts))):
        raise ValueError("order must be a permutation of range(len(tensors))")
    if tf.executing_eagerly() and native.library() is not None:
        return _eager_grouped(ts, names, op, compression, prescale_factor, postscale_factor, order, bucket_cap_mb, s)
    if tf.executing_eagerly():
        hs = {i: fx.allreduce_async(ts[i].numpy(), op=op, compression=compression, name=names[i],
                                    prescale=prescale_factor, postscale=postscale_factor,
                                    bucket_cap_mb=bucket_cap_mb, process_set=s.ps) for i in order}
        return [tf.convert_to_tensor(hs[i].wait()) for i in range(len(ts))]
    handles = submit_grouped(ts, names, op, compression, prescale_factor, postscale_factor, order, bucket_cap_mb,
                             s.ps)
    return wait_grouped(handles, ts)


def _native_single(kind, t, name, root, s):
    """broadcast/allgather through the native ops (eager or traced)."""
    if kind == "broadcast":
        root = root_index(root, s.ranks)  # the engine numbers ranks within the set
    elif t.shape.rank == 0:
        raise ValueError("allgather needs at least one dimension (concatenates along axis 0); use a[None]")
    _validate.numpy_dtype(_np_dtype(t))

    def run():
        out, h = native.submit(t, kind, name, root=int(root), process_set=s.id)
        return native.wait_gather(out, h) if kind == "allgather" else native.wait(out, h)

    if tf.executing_eagerly():
        return _eager(run)
    graph = _graph_checks(kind)
    pair = {}
    chained(graph, lambda: pair.setdefault("h", native.submit(t, kind, name, root=int(root), process_set=s.id))[1])
    out, h = pair["h"]
    if kind == "allgather":
        r = native.wait_gather(out, h)
        r.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
        return r
    return native.wait(out, h)


def _single(kind, tensor, name, root=0, process_set=None):
    t = tf.convert_to_tensor(tensor)
    s = _Set(process_set)
    name = _op_name(kind, name, s.id)
    if native.library() is not None:
        return _native_single(kind, t, name, root, s)
    if tf.executing_eagerly():
        x = t.numpy()
        out = (fx.broadcast(x, root=root, name=name, process_set=s.ps) if kind == "broadcast"
               else fx.allgather(x, name=name, process_set=s.ps))
        return tf.convert_to_tensor(out)
    if kind == "broadcast":
        root_index(root, s.ranks)  # a bad root fails at trace time, as on the native path
    graph = _graph_checks(kind)
    h = chained(graph, lambda: tf.numpy_function(
        lambda x: np.int64(_submit(kind, x, name, "sum", "none", 1.0, 1.0, root, None, s.ps)), [t], tf.int64,
        stateful=True, name=f"fastxfer_{kind}"))
    r = tf.numpy_function(_wait, [h], t.dtype, stateful=True, name="fastxfer_wait")
    if kind == "broadcast":
        r.set_shape(t.shape)
    else:
        r.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return r


def broadcast(tensor, root_rank=0, name=None, process_set=None):
    """Every rank gets root_rank's tensor (in a process set: a rank of the job in that set)."""
    return _single("broadcast", tensor, name, root_rank, process_set)


def allgather(tensor, name=None, process_set=None):
    """Concatenation of every rank's tensor along the first dimension (sizes may differ), in rank
    order (of the process set)."""
    return _single("allgather", tensor, name, 0, process_set)


def oob_allreduce(value, op=Average, name=None, process_set=None):
    """Reduce a small value (a metric, a flag) on the engine's out-of-band lane, which never waits
    behind gradient buckets. Eager only; returns a tensor of the same shape and dtype."""
    if not tf.executing_eagerly():
        raise fx.FastxferError("oob_allreduce runs eagerly (it blocks until every rank has called it); inside a "
                               "tf.function use allreduce")
    x = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    return tf.convert_to_tensor(fx.oob_allreduce(x, op=op, name=name, process_set=process_set))


# ---- alltoall and reducescatter ----------------------------------------------------------------
# Native ops (C++, asynchronous) like allgather: the result's first dimension is known only when
# the engine has run, so the wait op allocates it. Gradients as Horovod defines them: alltoall's
# is an alltoall back with the received splits; reducescatter's an allgather (times size for sum).


def _gather_kind(kind, t, name, s, op="sum", pre=1.0, post=1.0, splits=None):
    """Graph or eager: submit and wait one allgather-like collective through the native ops; returns
    the result (and, for alltoall, the received splits)."""
    def submit():
        if kind == "alltoall":
            return native.submit_splits(t, splits, name, s.id)
        o, _, p0, p1, _ = allreduce_settings(_np_dtype(t), op, "none", pre, post, None, s.size, divide=False)
        return native.submit(t, kind, name, o, "none", 0, p0, p1, 0, s.id)

    def wait(out, h):
        if kind == "alltoall":
            return native.wait_alltoall(out, h)
        return native.wait_gather(out, h)

    if tf.executing_eagerly():
        return _eager(lambda: wait(*submit()))
    graph = _graph_checks(kind)
    pair = {}
    chained(graph, lambda: pair.setdefault("h", submit())[1])
    return wait(*pair["h"])


def _bridge(kind, t, name, s, op="sum", pre=1.0, post=1.0, splits=None):
    """The same through the tf.numpy_function bridge (FASTXFER_TF_NATIVE=0, or no op library)."""
    def call(x, sp=None):
        if kind == "alltoall":
            out, rs = fx.alltoall(x, splits=None if sp is None or len(sp) == 0 else sp, name=name, process_set=s.ps)
            return out, rs.astype(np.int32)
        return fx.reducescatter(x, op=op, name=name, prescale=pre, postscale=post, process_set=s.ps)

    if tf.executing_eagerly():
        if kind == "alltoall":
            out, rs = call(t.numpy(), splits.numpy())
            return tf.convert_to_tensor(out), tf.convert_to_tensor(rs)
        return tf.convert_to_tensor(call(t.numpy()))
    graph = _graph_checks(kind)
    res = {}
    if kind == "alltoall":
        chained(graph, lambda: res.setdefault("r", tf.numpy_function(
            call, [t, splits], [t.dtype, tf.int32], stateful=True, name="fastxfer_alltoall"))[0].op)
        return tuple(res["r"])
    chained(graph, lambda: res.setdefault("r", tf.numpy_function(
        call, [t], t.dtype, stateful=True, name="fastxfer_reducescatter")).op)
    return res["r"]


def _run_gather_kind(kind, t, name, s, **kw):
    if native.library() is not None:
        return _gather_kind(kind, t, name, s, **kw)
    return _bridge(kind, t, name, s, **kw)


def _check_rank(t, what):
    if t.shape.rank == 0:
        raise ValueError(f"{what} needs at least one dimension (it splits the first one); use a[None]")
    if t.shape.rank is not None and t.shape.rank > 8:
        raise ValueError(f"{what} supports at most 8 dimensions, not {t.shape.rank}; reshape first")
    _validate.numpy_dtype(_np_dtype(t))


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=None):
    """Horovod's alltoall: rank r sends the j-th block of rows of ``tensor`` (axis 0; sizes
    ``splits``, a vector of one int per rank, default an equal split) to rank j, and receives the
    rows every rank sent it, concatenated in rank order. Returns the received tensor, and, when
    ``splits`` is given, also the received splits (int32), as Horovod does. Differentiable: the
    gradient is an alltoall back with the received splits. ``ignore_name_scope`` is accepted for
    Horovod compatibility (fastxfer's names never include a name scope)."""
    del ignore_name_scope
    t = tf.convert_to_tensor(tensor)
    _check_rank(t, "alltoall")
    s = _Set(process_set)
    sp = tf.constant([], tf.int32) if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)
    out, rsplits = _alltoall(t, sp, _op_name("alltoall", name, s.id), s)
    return (out, rsplits) if splits is not None else out


def _alltoall(t, sp, name, s):
    if not t.dtype.is_floating:
        out, rs = _run_gather_kind("alltoall", t, name, s, splits=sp)
        return _shaped(out, t), rs
    held = {}

    @tf.custom_gradient
    def fn(x):
        out, rs = _run_gather_kind("alltoall", x, name, s, splits=sp)
        held["rs"] = rs

        def grad(dy):
            back, _ = _run_gather_kind("alltoall", tf.convert_to_tensor(dy), _op_name("alltoall", None, s.id), s,
                                       splits=rs)
            return _shaped(back, x)

        return _shaped(out, x), grad

    out = fn(t)
    return out, held["rs"]


def _shaped(r, t):
    """A gathered result has an unknown first dimension; the rest is the input's."""
    if t.shape.rank is not None:
        r.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return r


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Horovod's reducescatter: reduce ``tensor`` (same shape on every rank) with ``op`` (Average or
    Sum) and return this rank's rows of the result; the first dimension is split as evenly as
    possible, the first (rows mod size) ranks getting one row more. ``compression`` (fp16/bf16)
    casts floating tensors to 16 bits for the collective and back, as Horovod's compressors do.
    Differentiable: the gradient is an allgather (times size for Sum), as Horovod defines it."""
    del device_dense, ignore_name_scope
    s = _Set(process_set)
    return grouped_reducescatter([tensor], compression=compression, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, names=[_op_name("reducescatter", name, s.id)],
                                 process_set=process_set)[0]


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average, prescale_factor=1.0,
                          postscale_factor=1.0, names=None, process_set=None):
    """reducescatter of every tensor in the list: all submitted (in list order) before any result is
    waited for."""
    del device_dense
    s = _Set(process_set)
    op = check_op(op)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter takes op Average or Sum, not {op!r}")
    compression = _validate.compression(compression)
    ts = [tf.convert_to_tensor(t) for t in tensors]
    if names is None:
        names = [_op_name("reducescatter", None, s.id) for _ in ts]
    elif len(names) != len(ts):
        raise ValueError(f"{len(names)} names for {len(ts)} tensors")
    wire = {"bf16": tf.bfloat16, "fp16": tf.float16}.get(compression)
    outs = []
    pending = []
    for t, name in zip(ts, names):
        _check_rank(t, "reducescatter")
        orig = t.dtype
        if wire is not None and orig.is_floating:
            t = tf.cast(t, wire)
        allreduce_settings(_np_dtype(t), op, "none", prescale_factor, postscale_factor, None, s.size)  # checks only
        pending.append((t, name, orig))
    for t, name, orig in pending:
        outs.append(_reducescatter_one(t, name, op, prescale_factor, postscale_factor, orig, s))
    return outs


def _reducescatter_one(t, name, op, pre, post, orig, s):
    def run(x):
        r = _shaped(_run_gather_kind("reducescatter", x, name, s, op=op, pre=pre, post=post), x)
        return tf.cast(r, orig) if r.dtype != orig else r

    if not t.dtype.is_floating:
        return run(t)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            if op == Sum:
                dy = dy * tf.cast(s.size, dy.dtype)
            g = allgather(dy, process_set=s.ps)
            return tf.cast(g, x.dtype) if g.dtype != x.dtype else g

        return run(x), grad

    return fn(t)
