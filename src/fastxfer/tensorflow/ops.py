"""Collectives on tf.Tensors, given their checked options: allreduce, grouped_allreduce (and its
submit/wait halves for the gradient tape), broadcast, allgather, alltoall, reducescatter,
grouped_reducescatter, oob_allreduce; and how unnamed collectives are named.

Each function takes a ``CollectiveOptions`` built once by the public entry (api.py with Horovod's
signatures, tape.py, the Keras optimizer) and reaches the engine through backend.py's
``submit``/``wait`` only, eagerly or inside tf.function. Nothing here validates an option again;
what depends on a tensor (its dtype against the options, its rank) is checked here, at trace time.
These ops are not XLA-compilable: a function compiled with jit_compile=True must keep them
outside the compiled part (backend.py refuses with a clear error).
"""

from __future__ import annotations

import itertools
import threading
import zlib
from dataclasses import replace

import numpy as np
import tensorflow as tf

import fastxfer as fx
from fastxfer import _validate, settings
from fastxfer.comm.collectives import check_first_dim
from fastxfer.comm.options import CollectiveOptions
from fastxfer.tensorflow import backend

# Horovod's names of the reduction ops: the op names themselves
Average, Sum, Min, Max, Product = "average", "sum", "min", "max", "product"

_lock = threading.Lock()
_eager_names = itertools.count()
_set_names: dict[int, itertools.count] = {}


@fx.comm.group.on_shutdown
def _forget_names() -> None:
    # eager names are per job: after a shutdown (an elastic reset, say) every rank, old or new,
    # numbers them from 0 again
    global _eager_names
    with _lock:
        _eager_names = itertools.count()
        _set_names.clear()


def op_name(kind: str, name: str | None, set_id: int = 0) -> str:
    """A name for an unnamed collective. In a traced function: a counter kept on that graph, so the
    names are fixed at trace time and identical on every rank that traces the same function, even
    if some rank traced other functions (or this one again) in between; eagerly: a process-wide
    counter, the same sequence on every rank that makes the same calls."""
    if name is not None:
        return name
    if set_id:
        kind = f"{kind}.set{set_id}"  # only the set's ranks call its collectives: numbered apart
    if tf.executing_eagerly():
        with _lock:
            c = _set_names.setdefault(set_id, itertools.count()) if set_id else _eager_names
            return f"tf.{kind}.{next(c)}"
    graph = tf.compat.v1.get_default_graph()
    n = getattr(graph, "_fastxfer_names", 0)
    setattr(graph, "_fastxfer_names", n + 1)
    return f"tf.graph.{kind}.{n}"


def _names(kind, opts: CollectiveOptions, n: int, names=None) -> list[str]:
    """One name per tensor of a grouped call: ``names`` as given, else ``opts.name.i``, else automatic."""
    if names is not None:
        if len(names) != n:
            raise ValueError(f"{len(names)} names for {n} tensors")
        return list(names)
    return [op_name(kind, None if opts.name is None else f"{opts.name}.{i}", opts.set_id) for i in range(n)]


def _np_dtype(t) -> np.dtype:
    """The tensor's dtype as numpy names it; TypeError for one the engine does not move."""
    return _validate.numpy_dtype(np.dtype(t.dtype.as_numpy_dtype))


# ---- allreduce ---------------------------------------------------------------------------------

HOLD_BYTES = 1 << 20  # a held run of submits ends once it holds this much (or the bucket cap, if less)


def held(tensors, order, opts: CollectiveOptions, groups=None) -> set:
    """The indexes of a grouped allreduce whose submits may hold (backend.submit). Without
    ``groups``: in submission order, runs of tensors up to ``HOLD_BYTES`` on the wire (or the
    bucket cap, if smaller), every one held but the last of its run, and never the last of the
    group. The engine then negotiates a run of small gradients in one round when its last tensor
    arrives, instead of starting a round at the first and one more for each tensor that arrives
    while it runs (measured: a round per tensor for a model of ten small tensors). Past about a
    MiB a round's fixed cost is small against the reduction, and holding longer only delays it
    (ResNet-50 was slower held to whole 25 MiB buckets): docs/architecture.md, "Grouped submits".
    A tensor of unknown size ends a run. With ``groups`` (lists of indexes, each in submission
    order: Horovod's groups=/num_groups=) each group is one run, whatever its size: every tensor
    held but its group's last. FASTXFER_TF_HOLD=0 holds none (read when the graph is traced)."""
    if not settings.get("FASTXFER_TF_HOLD") or not backend.use_native():
        return set()
    if groups is not None:
        return {i for g in groups for i in g[:-1]}
    order = list(order)
    limit = min(opts.bucket_cap or fx.comm.group.settings().get("cap", 25 << 20), HOLD_BYTES)
    hold, filled = set(), 0
    for k, i in enumerate(order):
        t = tensors[i]
        n = t.shape.num_elements()
        if k == len(order) - 1 or n is None:
            filled = 0
            continue
        filled += n * (2 if opts.wire_for(_np_dtype(t)) in ("bf16", "fp16") else t.dtype.size)
        if filled >= limit:
            filled = 0
            continue
        hold.add(i)
    return hold


def group_tag(name: str) -> int:
    """The engine's fusion-group tag of a group whose first submit is named ``name``: nonzero, the
    same on every rank that agrees on the names (the engine compares names, not tags), and
    different for the groups next to it (csrc/engine/c_api.h, ``fx_request.group``)."""
    return (zlib.crc32(name.encode()) & 0x7FFFFFFF) | 1


def _groups_in_order(order, groups) -> list:
    """``groups`` (lists of indexes) checked against ``order``: they must be ``order`` cut into
    consecutive pieces (a group's submits follow each other, so it is one held run)."""
    flat = [i for g in groups for i in g]
    if flat != list(order) or any(not g for g in groups):
        raise ValueError("groups must cut the submission order into consecutive, non-empty pieces")
    return [list(g) for g in groups]


def submit_grouped(tensors, opts: CollectiveOptions, names, order=None, groups=None) -> list:
    """One submit per tensor, in ``order`` (default: list order; with ``groups``, their
    concatenation), each running as soon as its tensor exists (in a traced function: after the
    graph's previous submit). ``groups``: lists of indexes, each list one fusion group -- held
    until its last submit and never sharing a bucket with another group. Returns the backend's
    Pending by tensor index, for ``wait_grouped``."""
    if groups is not None:
        order = [i for g in groups for i in g] if order is None else list(order)
        groups = _groups_in_order(order, groups)
    order = list(range(len(tensors))) if order is None else list(order)
    for t in tensors:
        opts.check_dtype(_np_dtype(t), strict_compression=False)
    holds = held(tensors, order, opts, groups)
    tag = {}
    for g in groups or ():
        for i in g:
            tag[i] = group_tag(names[g[0]])
    pending = [None] * len(tensors)
    if groups is not None and not tf.executing_eagerly():
        # traced: a group's submits run once all its tensors exist, back to back (as Horovod runs a
        # group when its last tensor is ready); otherwise a pause inside the backward pass could
        # pass the engine's hold time and cut the group in two rounds, hence two buckets
        for g in groups:
            with tf.control_dependencies([tensors[i] for i in g]):
                for i in g:
                    pending[i] = backend.submit(tensors[i], opts, names[i], hold=i in holds, group=tag[i])
        return pending
    for i in order:
        pending[i] = backend.submit(tensors[i], opts, names[i], hold=i in holds, group=tag.get(i, 0))
    return pending


def wait_grouped(pending) -> list:
    """The results of ``submit_grouped``, each with its input's shape and dtype. One wait per
    tensor, so whatever uses a result (the optimizer's update of that variable) can run as soon
    as it is reduced."""
    return [backend.wait(p) for p in pending]


def grouped_allreduce(tensors, opts: CollectiveOptions, names=None, order=None, groups=None) -> list:
    """Reduce a list of tensors, fused by the engine, submitted in ``order`` (a permutation of the
    indexes; gradients go last layer first, the order a backward pass produces them). ``groups``
    (lists of indexes cutting ``order`` into consecutive pieces): each one fusion group
    (submit_grouped). A user compressor in ``opts`` runs around an uncompressed reduction of the
    compressed tensors."""
    ts = [tf.convert_to_tensor(t) for t in tensors]
    names = _names("allreduce", opts, len(ts), names)
    if order is None and groups is not None:
        order = [i for g in groups for i in g]
    order = list(range(len(ts))) if order is None else list(order)
    if sorted(order) != list(range(len(ts))):
        raise ValueError("order must be a permutation of range(len(tensors))")
    ctxs = None
    if opts.compressor is not None:
        pairs = [opts.compressor.compress(t) for t in ts]
        ts, ctxs = [tf.convert_to_tensor(p[0]) for p in pairs], [p[1] for p in pairs]
    out = wait_grouped(submit_grouped(ts, opts, names, order, groups))
    if ctxs is not None:
        out = [opts.compressor.decompress(r, c) for r, c in zip(out, ctxs)]
    return out


def allreduce(tensor, opts: CollectiveOptions):
    """Reduce one tensor across the ranks of ``opts``' set; same shape and dtype."""
    return grouped_allreduce([tensor], opts, [op_name("allreduce", opts.name, opts.set_id)])[0]


# ---- broadcast, allgather ----------------------------------------------------------------------


def broadcast(tensor, opts: CollectiveOptions):
    """Every rank gets the root's tensor."""
    t = tf.convert_to_tensor(tensor)
    opts.check_dtype(_np_dtype(t))
    return backend.wait(backend.submit(t, opts, op_name("broadcast", opts.name, opts.set_id)))


def allgather(tensor, opts: CollectiveOptions):
    """Every rank's tensor concatenated along the first dimension (sizes may differ), in rank
    order (of the process set)."""
    t = tf.convert_to_tensor(tensor)
    check_first_dim(t.shape.rank, "allgather")
    opts.check_dtype(_np_dtype(t))
    return backend.wait(backend.submit(t, opts, op_name("allgather", opts.name, opts.set_id)))


def gather_slices(s: tf.IndexedSlices, op: str, opts: CollectiveOptions, values_name, indices_name):
    """An IndexedSlices "reduced" Horovod's way: every rank's values and indices allgathered
    (duplicate indices add up when applied), the values divided by the number of ranks (of the
    process set) for Average."""
    if op not in (Sum, Average):
        raise NotImplementedError(f"op={op!r}: only Sum and Average ops are supported with tf.IndexedSlices")
    g = replace(opts, kind="allgather", op="sum", compression="none", compressor=None, prescale=1.0, postscale=1.0)
    values = allgather(s.values, replace(g, name=values_name))
    indices = allgather(s.indices, replace(g, name=indices_name))
    if op == Average:
        values = values / tf.cast(opts.size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)


def oob_allreduce(value, op=Average, name=None, process_set=None):
    """Reduce a small value (a metric, a flag) on the engine's out-of-band lane, which never waits
    behind gradient buckets. Eager only; returns a tensor of the same shape and dtype."""
    if not tf.executing_eagerly():
        raise fx.FastxferError("oob_allreduce runs eagerly (it blocks until every rank has called it); inside a "
                               "tf.function use allreduce")
    x = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    return tf.convert_to_tensor(fx.oob_allreduce(x, op=op, name=name, process_set=process_set))


# ---- alltoall and reducescatter ----------------------------------------------------------------
# The result's first dimension is known only when the engine has run. Gradients as Horovod defines
# them: alltoall's is an alltoall back with the received splits; reducescatter's an allgather
# (times size for sum).


def alltoall(tensor, splits, opts: CollectiveOptions):
    """(received rows, received splits int32): rank r sends the j-th block of rows of ``tensor``
    (sizes ``splits``, an int vector with one entry per rank, or None: an equal split) to rank j.
    Differentiable for floating tensors."""
    t = tf.convert_to_tensor(tensor)
    check_first_dim(t.shape.rank, "alltoall")
    opts.check_dtype(_np_dtype(t))
    sp = tf.constant([], tf.int32) if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)
    name = op_name("alltoall", opts.name, opts.set_id)
    if not t.dtype.is_floating:
        return backend.wait(backend.submit(t, opts, name, splits=sp))
    received = {}

    @tf.custom_gradient
    def fn(x):
        out, rs = backend.wait(backend.submit(x, opts, name, splits=sp))
        received["splits"] = rs

        def grad(dy):
            back, _ = backend.wait(backend.submit(tf.convert_to_tensor(dy), opts,
                                                  op_name("alltoall", None, opts.set_id), splits=rs))
            return back

        return out, grad

    out = fn(t)
    return out, received["splits"]


def grouped_reducescatter(tensors, opts: CollectiveOptions, names=None) -> list:
    """reducescatter of every tensor in the list (same shape on every rank): all submitted (in list
    order) before any result is waited for; each rank gets its rows of the reduced tensor, the
    first (rows mod size) ranks one row more. ``opts.compression`` (fp16/bf16) casts floating
    tensors to 16 bits for the collective and back, as Horovod's compressors do. Differentiable."""
    ts = [tf.convert_to_tensor(t) for t in tensors]
    names = _names("reducescatter", opts, len(ts), names)
    wire = {"bf16": tf.bfloat16, "fp16": tf.float16}.get(opts.compression)
    reduce_opts = replace(opts, compression="none")
    pending = []
    for t, name in zip(ts, names):
        check_first_dim(t.shape.rank, "reducescatter")
        orig = t.dtype
        if wire is not None and orig.is_floating:
            t = tf.cast(t, wire)
        reduce_opts.check_dtype(_np_dtype(t))
        pending.append((t, name, orig))
    return [_reducescatter_one(t, name, orig, reduce_opts) for t, name, orig in pending]


def _reducescatter_one(t, name, orig, opts: CollectiveOptions):
    def run(x):
        r = backend.wait(backend.submit(x, opts, name))
        return tf.cast(r, orig) if r.dtype != orig else r

    if not t.dtype.is_floating:
        return run(t)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            if opts.op == Sum:
                dy = dy * tf.cast(opts.size, dy.dtype)
            g = allgather(dy, replace(opts, kind="allgather", op="sum", prescale=1.0, postscale=1.0, name=None))
            return tf.cast(g, x.dtype) if g.dtype != x.dtype else g

        return run(x), grad

    return fn(t)


__all__ = ["Average", "HOLD_BYTES", "Max", "Min", "Product", "Sum", "allgather", "allreduce", "alltoall", "broadcast",
           "gather_slices", "group_tag", "grouped_allreduce", "grouped_reducescatter", "held", "oob_allreduce", "op_name",
           "submit_grouped", "wait_grouped"]
