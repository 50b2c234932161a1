"""Gradients through the public collectives, as Horovod defines them (horovod/tensorflow/mpi_ops.py),
for models that call collectives inside their layers (SyncBatchNorm-style layers, model
parallelism) under a GradientTape, eagerly or in a tf.function:

=================  ====================================================================================
allreduce          the same allreduce of the gradient (op, prescale and postscale, process set)
grouped_allreduce  the same grouped allreduce of the gradients
allgather          the Average allreduce of the gradient, then this rank's rows (the first dimensions
                   allgathered)
broadcast          the Average allreduce of the gradient on the root; zeros on the other ranks
=================  ====================================================================================

alltoall's and reducescatter's gradients live with them (ops.py). Only floating tensors carry
gradients; integer ones go through unchanged. The optimizer's own gradient reduction (tape.py) does
not come through here: it is never differentiated, and keeps its buffers forwarded in place.
"""

from __future__ import annotations

from dataclasses import replace

import tensorflow as tf

from fastxfer.comm import group
from fastxfer.comm import options as options_mod
from fastxfer.comm.options import CollectiveOptions
from fastxfer.tensorflow import ops


def _floating(tensors) -> bool:
    return all(t.dtype.is_floating for t in tensors)


def _set_rank(opts: CollectiveOptions) -> int:
    ranks = opts.ranks
    return ranks.index(group.rank()) if ranks else group.rank()


def _average(opts: CollectiveOptions) -> CollectiveOptions:
    """An Average allreduce in the same process set, named by the engine's counter."""
    return options_mod.allreduce("average", process_set=opts.process_set)


def grouped_allreduce(tensors, opts: CollectiveOptions, names=None, order=None, one_group=False) -> list:
    """``one_group``: the list is one fusion group (Horovod's grouped_allreduce: held until its last
    tensor, in buckets of its own), and so is its gradient's."""
    def groups(n):
        return [list(range(n)) if order is None else list(order)] if one_group and n else None

    if not _floating(tensors):
        return ops.grouped_allreduce(tensors, opts, names, order, groups(len(tensors)))
    grad_opts = replace(opts, name=None)

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            return ops.grouped_allreduce([tf.convert_to_tensor(d) for d in dys], grad_opts,
                                         groups=groups(len(dys)) if order is None else None)

        return ops.grouped_allreduce(list(xs), opts, names, order, groups(len(xs))), grad

    return list(fn(*tensors))


def allreduce(tensor, opts: CollectiveOptions):
    return grouped_allreduce([tensor], opts, [ops.op_name("allreduce", opts.name, opts.set_id)])[0]


def allgather(tensor, opts: CollectiveOptions):
    t = tf.convert_to_tensor(tensor)
    if not t.dtype.is_floating:
        return ops.allgather(t, opts)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            g = ops.allreduce(tf.convert_to_tensor(dy), _average(opts))
            rows = ops.allgather(tf.reshape(tf.shape(x, out_type=tf.int32)[0], [1]), replace(opts, name=None))
            parts = tf.split(g, rows, axis=0, num=opts.size)
            return parts[_set_rank(opts)]

        return ops.allgather(x, opts), grad

    return fn(t)


def broadcast(tensor, opts: CollectiveOptions):
    t = tf.convert_to_tensor(tensor)
    if not t.dtype.is_floating:
        return ops.broadcast(t, opts)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            g = ops.allreduce(tf.convert_to_tensor(dy), _average(opts))
            return g if _set_rank(opts) == opts.root else tf.zeros_like(g)

        return ops.broadcast(x, opts), grad

    return fn(t)
