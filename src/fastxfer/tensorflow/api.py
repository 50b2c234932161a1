"""Horovod's collectives on tensors with Horovod's signatures: ``allreduce``, ``grouped_allreduce``,
``allgather``, ``grouped_allgather``, ``broadcast``, ``broadcast_``, ``alltoall``, ``reducescatter``,
``grouped_reducescatter``, ``join``.

This is the public entry of every TensorFlow collective: each function turns its arguments into
one ``CollectiveOptions`` here (fastxfer.comm.options: the only place they are checked) and hands
it to ``ops``, which reaches the engine through ``backend``. What Horovod's front end adds in
TensorFlow is done here too:

- ``op=None`` means Average; ``average=`` (deprecated in Horovod 0.19) still works, and giving both
  is a ValueError, as in Horovod;
- tf.IndexedSlices (sparse gradients) are allgathered (values and indices; Average divides the
  values by the number of ranks) instead of reduced;
- ``compression=`` takes Horovod's compressor objects, fastxfer's built-ins or any user compressor
  (compression.py);
- ``device_dense``, ``device_sparse``, ``ignore_name_scope`` are accepted and have no effect (the
  collectives run on the host; names are never scoped);
- ``process_set``: a registered set (fastxfer.comm.process_sets) runs the collective among its
  ranks, on its own engine; a broadcast's root is then a rank of the job inside the set. On a
  set this rank is not in, every collective raises an error that is both fastxfer's
  NotInProcessSetError and Horovod's tf.errors.InvalidArgumentError (errors.py).

``join`` is the engine's (fastxfer.join), eagerly, on the global set.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import tensorflow as tf

import fastxfer as fx
from fastxfer.comm import options
from fastxfer.tensorflow import gradients, ops
from fastxfer.tensorflow.basics import global_process_set
from fastxfer.tensorflow.compression import Compression
from fastxfer.tensorflow.errors import tf_errors

# Python that builds graphs without data-dependent control flow: nothing for AutoGraph to convert
_no_autograph = tf.autograph.experimental.do_not_convert

Average, Sum, Min, Max, Product = ops.Average, ops.Sum, ops.Min, ops.Max, ops.Product
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
    return handle_average_backwards_compatibility(op, average)


def allreduce_options(op=None, average=None, compression=Compression.none, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, name=None, bucket_cap_mb=None):
    """The options of a TensorFlow allreduce from Horovod's arguments (user compressors allowed)."""
    return options.allreduce(_op(op, average), compression, prescale_factor, postscale_factor, bucket_cap_mb,
                             process_set, name, compressors=True)


def _sparse(s: tf.IndexedSlices, opts, name) -> tf.IndexedSlices:
    if opts.prescale != 1.0 or opts.postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    if opts.op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    return ops.gather_slices(s, opts.op, opts, None if name is None else f"{name}.values",
                             None if name is None else f"{name}.indices")


@_no_autograph
@tf_errors
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce a tensor (or tf.Variable, or tf.IndexedSlices) across all ranks, eagerly or inside a
    tf.function. ``op``: Average (default), Sum, Min, Max, Product. A tf.IndexedSlices is
    allgathered (values and indices) instead, as in Horovod."""
    opts = allreduce_options(op, average, compression, prescale_factor, postscale_factor, process_set, name)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse(tensor, opts, name)
    return gradients.allreduce(tf.convert_to_tensor(tensor), opts)


@_no_autograph
@tf_errors
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None, names=None, order=None, bucket_cap_mb=None):
    """Reduce a list of tensors as one group, as Horovod does: the dense ones are held until the
    last is submitted and fused into buckets of their own (several when they pass the bucket cap);
    tf.IndexedSlices in the list are allgathered.
    fastxfer's additions: ``names`` (one per tensor, identical on every rank), ``order`` (a
    permutation: the order the dense tensors are handed to the engine, e.g. reversed for gradients)
    and ``bucket_cap_mb``."""
    opts = allreduce_options(op, average, compression, prescale_factor, postscale_factor, process_set, name,
                             bucket_cap_mb)
    if not tensors:
        return tensors
    tensors = list(tensors)
    n = len(tensors)
    if names is not None and len(names) != n:
        raise ValueError(f"{len(names)} names for {n} tensors")
    if names is None and name is not None:
        names = [f"{name}.{i}" for i in range(n)]
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of range(len(tensors))")
    out = [None] * n
    dense = [i for i in order if not isinstance(tensors[i], tf.IndexedSlices)]
    if dense:
        red = gradients.grouped_allreduce([tf.convert_to_tensor(tensors[i]) for i in dense], opts,
                                          None if names is None else [names[i] for i in dense], one_group=True)
        for i, r in zip(dense, red):
            out[i] = r
    for i in order:
        if isinstance(tensors[i], tf.IndexedSlices):
            out[i] = _sparse(tensors[i], opts, None if names is None else names[i])
    return out


@_no_autograph
@tf_errors
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenation of every rank's tensor along the first dimension (which may differ between ranks)."""
    return gradients.allgather(tensor, options.gather("allgather", process_set, name))


@_no_autograph
@tf_errors
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """allgather of each tensor of a list."""
    opts = options.gather("allgather", process_set, name)
    return [gradients.allgather(t, opts if name is None else replace(opts, name=f"{name}.{i}"))
            for i, t in enumerate(tensors)]


@_no_autograph
@tf_errors
def broadcast(tensor, root_rank=0, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank gets root_rank's tensor (in a process set: a rank of the job in that set)."""
    return gradients.broadcast(tensor, options.broadcast(root_rank, process_set, name))


@_no_autograph
@tf_errors
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Broadcast root_rank's values into ``variables`` in place; returns their new values."""
    from fastxfer.tensorflow.functions import broadcast_variables

    variables = list(variables) if isinstance(variables, (list, tuple)) else [variables]
    broadcast_variables(variables, root_rank, name=name, process_set=process_set)
    return [tf.convert_to_tensor(v) for v in variables]


@_no_autograph
@tf_errors
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Horovod's alltoall: rank r sends the j-th block of rows of ``tensor`` (axis 0; sizes
    ``splits``, a vector of one int per rank -- of the process set, in its order --, default an
    equal split) to rank j, and receives the rows every rank sent it, concatenated in rank order.
    Returns the received tensor, and, when ``splits`` is given, also the received splits (int32),
    as Horovod does. Differentiable: the gradient is an alltoall back with the received splits."""
    out, rsplits = ops.alltoall(tensor, splits, options.gather("alltoall", process_set, name))
    return (out, rsplits) if splits is not None else out


@_no_autograph
@tf_errors
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Horovod's reducescatter: reduce ``tensor`` (same shape on every rank) with ``op`` (Average or
    Sum) and return this rank's rows of the result; the first dimension is split as evenly as
    possible, the first (rows mod size) ranks getting one row more. ``compression`` (fp16/bf16)
    casts floating tensors to 16 bits for the collective and back, as Horovod's compressors do.
    Differentiable: the gradient is an allgather (times size for Sum), as Horovod defines it."""
    opts = options.reducescatter(op, compression, prescale_factor, postscale_factor, process_set, name)
    return ops.grouped_reducescatter([tensor], opts, [ops.op_name("reducescatter", name, opts.set_id)])[0]


@_no_autograph
@tf_errors
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of every tensor in the list: all submitted (in list order) before any result is
    waited for."""
    return ops.grouped_reducescatter(tensors, options.reducescatter(op, compression, prescale_factor, postscale_factor,
                                                                    process_set))


def join(device="") -> tf.Tensor:
    """Horovod's join: this rank has no more batches. Until every rank has joined it stands in for
    the allreduces the others still run (with the op's neutral element; fastxfer.join); returns the
    rank that joined last as an int32 tensor. Eager only (it blocks the calling thread)."""
    del device
    if not tf.executing_eagerly():
        raise NotImplementedError("join() runs eagerly (call it outside tf.function, after the training loop)")
    return tf.constant(fx.join(), tf.int32)
