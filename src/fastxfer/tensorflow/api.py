"""Horovod's collectives on tensors with Horovod's signatures: ``allreduce``, ``grouped_allreduce``,
``allgather``, ``grouped_allgather``, ``broadcast``, ``broadcast_`` -- over ``ops`` (the native
submit/wait ops), adding what Horovod's front end does in TensorFlow:

- ``op=None`` means Average; ``average=`` (deprecated in Horovod 0.19) still works, and giving both
  is a ValueError, as in Horovod;
- tf.IndexedSlices (sparse gradients) are allgathered (values and indices; Average divides the
  values by the number of ranks) instead of reduced;
- ``compression=`` takes Horovod's compressor objects, fastxfer's built-ins or any user compressor
  (compression.py);
- ``device_dense``, ``device_sparse``, ``ignore_name_scope`` are accepted and have no effect (the
  collectives run on the host; names are never scoped);
- ``process_set``: a registered set (fastxfer.comm.process_sets) runs the collective among its
  ranks, on its own engine; a broadcast's root is then a rank of the job inside the set.

``alltoall``, ``reducescatter`` and ``grouped_reducescatter`` are ``ops``' native collectives;
``join`` is the engine's (fastxfer.join), eagerly, on the global set.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

import fastxfer as fx
from fastxfer.tensorflow import ops
from fastxfer.tensorflow.basics import global_process_set, resolve_process_set
from fastxfer.tensorflow.compression import Compression, resolve

# Python that builds graphs without data-dependent control flow: nothing for AutoGraph to convert
_no_autograph = tf.autograph.experimental.do_not_convert

Average, Sum, Min, Max = ops.Average, ops.Sum, ops.Min, ops.Max
Product = getattr(ops, "Product", "product")
Adasum = "adasum"

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allreduce", "alltoall", "broadcast",
           "broadcast_", "check_num_rank_power_of_2", "grouped_allgather", "grouped_allreduce",
           "grouped_reducescatter", "handle_average_backwards_compatibility", "join", "reducescatter"]


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule for the deprecated ``average`` keyword: ``op`` wins, both is an error, neither
    is Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def check_num_rank_power_of_2(num_rank) -> bool:
    """Whether num_rank is a power of 2 (Horovod's helper, used for Adasum)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def _op(op, average):
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(op, str) and op.lower() == Adasum:
        raise NotImplementedError("op=Adasum: fastxfer does not implement Adasum; use Average (or Sum)")
    return ops.check_op(op)


def wire_for(tensor, wire: str) -> str:
    """The engine compresses float32 only; other dtypes travel as they are (Horovod's fp16
    compressor likewise leaves non-float tensors alone)."""
    return wire if tensor.dtype == tf.float32 else "none"


def _sparse(s: tf.IndexedSlices, op, name, prescale_factor, postscale_factor, ps=None) -> tf.IndexedSlices:
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    return gather_slices(s, op, None if name is None else f"{name}.values", None if name is None else f"{name}.indices",
                         ps)


def gather_slices(s: tf.IndexedSlices, op, values_name, indices_name, ps=None) -> tf.IndexedSlices:
    """An IndexedSlices "reduced" Horovod's way: every rank's values and indices concatenated
    (duplicate indices add up when applied), the values divided by the number of ranks (of the
    process set ``ps``) for Average."""
    values = ops.allgather(s.values, name=values_name, process_set=ps)
    indices = ops.allgather(s.indices, name=indices_name, process_set=ps)
    if op == Average:
        values = values / tf.cast(fx.size() if ps is None else ps.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)


@_no_autograph
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce a tensor (or tf.Variable, or tf.IndexedSlices) across all ranks, eagerly or inside a
    tf.function. ``op``: Average (default), Sum, Min, Max. A tf.IndexedSlices is allgathered
    (values and indices) instead, as in Horovod."""
    ps = resolve_process_set(process_set)
    op = _op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse(tensor, op, name, prescale_factor, postscale_factor, ps)
    wire, user = resolve(compression)
    t = tf.convert_to_tensor(tensor)
    if user is not None:
        c, ctx = user.compress(t)
        r = ops.allreduce(c, op=op, compression="none", name=name, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=ps)
        return user.decompress(r, ctx)
    return ops.allreduce(t, op=op, compression=wire_for(t, wire), name=name, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=ps)


@_no_autograph
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None, names=None, order=None, bucket_cap_mb=None):
    """Reduce a list of tensors (fused by the engine); tf.IndexedSlices in the list are allgathered.
    fastxfer's additions: ``names`` (one per tensor, identical on every rank), ``order`` (a
    permutation: the order the dense tensors are handed to the engine, e.g. reversed for gradients)
    and ``bucket_cap_mb``."""
    ps = resolve_process_set(process_set)
    if not tensors:
        return tensors
    tensors = list(tensors)
    op = _op(op, average)
    n = len(tensors)
    if names is not None and len(names) != n:
        raise ValueError(f"{len(names)} names for {n} tensors")
    if names is None and name is not None:
        names = [f"{name}.{i}" for i in range(n)]
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of range(len(tensors))")
    out = [None] * n
    sparse = [i for i in order if isinstance(tensors[i], tf.IndexedSlices)]
    dense = [i for i in order if not isinstance(tensors[i], tf.IndexedSlices)]
    if dense:
        wire, user = resolve(compression)
        ts = {i: tf.convert_to_tensor(tensors[i]) for i in dense}
        ctxs = {}
        if user is not None:
            for i in dense:
                ts[i], ctxs[i] = user.compress(ts[i])
        wires = {i: ("none" if user is not None else wire_for(ts[i], wire)) for i in dense}
        for w in dict.fromkeys(wires[i] for i in dense):  # one grouped call per wire format, in `order`
            idx = [i for i in dense if wires[i] == w]
            red = ops.grouped_allreduce([ts[i] for i in idx], op=op, compression=w, prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor,
                                        names=None if names is None else [names[i] for i in idx],
                                        bucket_cap_mb=bucket_cap_mb, process_set=ps)
            for i, r in zip(idx, red):
                out[i] = user.decompress(r, ctxs[i]) if user is not None else r
    for i in sparse:
        out[i] = _sparse(tensors[i], op, None if names is None else names[i], prescale_factor, postscale_factor, ps)
    return out


@_no_autograph
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenation of every rank's tensor along the first dimension (which may differ between ranks)."""
    ps = resolve_process_set(process_set)
    return ops.allgather(tensor, name=name, process_set=ps)


@_no_autograph
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """allgather of each tensor of a list."""
    ps = resolve_process_set(process_set)
    return [ops.allgather(t, name=None if name is None else f"{name}.{i}", process_set=ps)
            for i, t in enumerate(tensors)]


@_no_autograph
def broadcast(tensor, root_rank=0, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank gets root_rank's tensor."""
    ps = resolve_process_set(process_set)
    return ops.broadcast(tensor, root_rank, name=name, process_set=ps)


@_no_autograph
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Broadcast root_rank's values into ``variables`` in place; returns their new values."""
    resolve_process_set(process_set)
    from fastxfer.tensorflow.functions import broadcast_variables

    variables = list(variables) if isinstance(variables, (list, tuple)) else [variables]
    broadcast_variables(variables, root_rank, name=name, process_set=process_set)
    return [tf.convert_to_tensor(v) for v in variables]


@_no_autograph
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Horovod's alltoall (fastxfer.tensorflow.ops.alltoall); in a process set, ``splits`` has one
    entry per rank of the set."""
    ps = resolve_process_set(process_set)
    return ops.alltoall(tensor, splits, name=name, ignore_name_scope=ignore_name_scope, process_set=ps)


@_no_autograph
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Horovod's reducescatter (fastxfer.tensorflow.ops.reducescatter)."""
    ps = resolve_process_set(process_set)
    return ops.reducescatter(tensor, device_dense, compression, op, name, ignore_name_scope, prescale_factor,
                             postscale_factor, process_set=ps)


@_no_autograph
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Horovod's grouped_reducescatter (fastxfer.tensorflow.ops.grouped_reducescatter)."""
    ps = resolve_process_set(process_set)
    return ops.grouped_reducescatter(tensors, device_dense, compression, op, prescale_factor, postscale_factor,
                                     process_set=ps)


def join(device="") -> tf.Tensor:
    """Horovod's join: this rank has no more batches. Until every rank has joined it stands in for
    the allreduces the others still run (with the op's neutral element; fastxfer.join); returns the
    rank that joined last as an int32 tensor. Eager only (it blocks the calling thread)."""
    del device
    if not tf.executing_eagerly():
        raise NotImplementedError("join() runs eagerly (call it outside tf.function, after the training loop)")
    return tf.constant(fx.join(), tf.int32)
