"""What the Keras 3 (keras_optimizer.py) and tf-keras (tf_keras_optimizer.py) DistributedOptimizers share: their
settings and the checks on them, the gradient reduction, backward_passes_per_step accumulation,
and the run-time subclasses that carry them."""

from __future__ import annotations

import tensorflow as tf

import fastxfer as fx
from fastxfer.tensorflow.compression import Compression
from fastxfer.tensorflow.ops import Average, Sum
from fastxfer.tensorflow.backend import chained
from fastxfer.tensorflow.tape import (GradientReduction, check_groups, gradient_options,
                                      reduce_gradients as reduce_tensors)

WRAPPED = "_fastxfer_distributed"  # class attribute that marks a distributed optimizer class
ACCUMULATORS = "_fastxfer_acc"  # instance __dict__ key: backward_passes_per_step's local accumulators
PASSES = "_fastxfer_passes"  # instance __dict__ key: the pass counter (identical on every rank)


class Settings:
    """A DistributedOptimizer's arguments, checked (``new_settings``): how its gradients are
    reduced (``reduction``: the allreduce's options and the local variables) and how many
    backward passes are accumulated before each reduction."""

    def __init__(self, reduction: GradientReduction, backward_passes_per_step=1, average_aggregated_gradients=False):
        self.reduction = reduction
        self.k = backward_passes_per_step
        self.average_aggregated = bool(average_aggregated_gradients)

    @property
    def local(self):
        """register_local_var's variables and PartialDistributedOptimizer's local layers."""
        return self.reduction.local


def new_settings(compression=Compression.none, backward_passes_per_step=1, average_aggregated_gradients=False,
                 gradient_predivide_factor=1.0, bucket_cap_mb=None, op=Average, sparse_as_dense=False,
                 scale_local_gradients=True, process_set=None, num_groups=0, groups=None) -> Settings:
    """Checked settings for a new DistributedOptimizer: FastxferError before init(), ValueError
    naming a wrong argument."""
    if not fx.is_initialized():
        raise fx.FastxferError("call fastxfer.keras.init() before DistributedOptimizer()")
    if not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, not {backward_passes_per_step!r}")
    opts = gradient_options(op, compression, gradient_predivide_factor, bucket_cap_mb, process_set)
    if opts.op not in (Average, Sum):
        raise ValueError(f"op must be Average or Sum for gradients, not {op!r}")
    reduction = GradientReduction(opts, sparse_as_dense, scale_local_gradients=scale_local_gradients,
                                  prefix="DistributedOptimizer", groups=check_groups(num_groups, groups))
    return Settings(reduction, backward_passes_per_step, average_aggregated_gradients)


class LocalVarsMixin:
    """Horovod's register_local_var, on every fastxfer DistributedOptimizer class."""

    def register_local_var(self, var):
        """Registers a variable as worker local: its gradient is not reduced across ranks (and is
        divided by the number of ranks when ``scale_local_gradients``, Horovod's default)."""
        self._fastxfer.local.add_variable(var)


def is_distributed(optimizer) -> bool:
    """Is `optimizer` already a fastxfer DistributedOptimizer?"""
    return bool(getattr(optimizer, WRAPPED, False))


_classes: dict[type, type] = {}  # wrapped class -> its distributed subclass


def distributed_class(base: type, mixin: type) -> type:
    """The run-time subclass of `base` with `mixin`'s methods (and register_local_var) in front
    (one per class, so that two optimizers of one class share a type), named like `base`."""
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (mixin, LocalVarsMixin, base),
                   {"__module__": base.__module__, WRAPPED: True, "_fastxfer_base": base,
                    "__doc__": f"{base.__name__} reducing gradients with fastxfer."})
        _classes[base] = cls
    return cls


def accumulators(optimizer) -> list:
    """backward_passes_per_step's local accumulators of `optimizer` (and of the optimizer inside
    a LossScaleOptimizer): this rank's own partial gradients, never to be broadcast."""
    out = []
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for o in (optimizer, inner) if inner is not optimizer else (optimizer,):
        acc = o.__dict__.get(ACCUMULATORS)
        out += list(acc.values()) if isinstance(acc, dict) else list(acc or [])
    return out


def reduce_gradients(settings: Settings, grads, variables) -> list:
    """The gradients reduced across ranks as `settings` say."""
    if settings.reduction.opts.size == 1:
        return list(grads)  # one rank: nothing to reduce (Average and Sum, with any predivide factor, are the identity)
    return reduce_tensors(grads, variables, settings.reduction)


def accumulate_and_apply(settings: Settings, passes, accs, grads, variables, apply) -> None:
    """backward_passes_per_step: add `grads` to the local accumulators; on every k-th pass reduce
    them across ranks and call ``apply(reduced_grads)``. The pass counter is the same on every
    rank, so all ranks reduce on the same pass; in graph mode the decision is a tf.cond, chained
    with the graph's other collectives (TensorFlow does not order a cond against host callbacks)."""
    for a, g in zip(accs, grads):
        if g is not None:
            a.assign_add(tf.convert_to_tensor(g))
    passes.assign_add(1)
    present = [g is not None for g in grads]  # static: a None gradient stays None
    k = settings.k

    def reduce_and_apply():
        scale = 1.0 / k if settings.average_aggregated else 1.0
        local = [(tf.identity(a) * scale if scale != 1.0 else tf.identity(a)) if p else None
                 for a, p in zip(accs, present)]
        apply(reduce_gradients(settings, local, variables))
        for a in accs:
            a.assign(tf.zeros_like(a))
        return tf.constant(True)

    if tf.executing_eagerly():
        if int(passes.numpy()) % k == 0:
            reduce_and_apply()
        return
    graph = tf.compat.v1.get_default_graph()
    chained(graph, lambda: tf.cond(tf.equal(passes % k, 0), reduce_and_apply, lambda: tf.constant(False)))
