"""DistributedOptimizer for Keras 3 optimizers (and tf-keras 2.x ones, see _legacy.py).

The wrapper is a subclass of the wrapped optimizer's own class, made at run time, so
``isinstance(opt, keras.optimizers.SGD)`` still holds and checkpoints keep their layout;
``get_config`` is the wrapped class's, so a saved model reloads with the plain optimizer
(``fastxfer.keras.load_model`` wraps it again, as Horovod's does). Its ``apply`` reduces the gradients across ranks first and then
runs the wrapped class's ``apply`` unchanged, so clipping, weight decay, EMA and schedules all act
on the averaged gradient, identically on every rank.

Inside ``model.fit`` the reduction is traced into the training function: each gradient is handed
to fastxfer's engine by its own op as soon as TensorFlow has computed it (see
fastxfer.tensorflow), so the engine reduces the last layers' gradients while the backward pass is
still working on the first ones.
"""

from __future__ import annotations

import sys
import warnings

import keras
import tensorflow as tf

import fastxfer as _fx
import fastxfer.tensorflow as _ftf
from fastxfer.errors import FastxferError

_WRAPPED = "_fastxfer_distributed"


def _check_args(compression, backward_passes_per_step, gradient_predivide_factor, bucket_cap_mb, op):
    if compression not in (_ftf.Compression.none, _ftf.Compression.fp16, _ftf.Compression.bf16):
        raise ValueError(f"compression must be Compression.none, .fp16 or .bf16, not {compression!r}")
    if not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, not {backward_passes_per_step!r}")
    if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor must be a number > 0, not {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != _ftf.Average:
        raise ValueError("gradient_predivide_factor applies to op=Average only")
    if bucket_cap_mb is not None and not (isinstance(bucket_cap_mb, (int, float)) and 1.0 / 1024 <= bucket_cap_mb
                                          <= 4096):
        raise ValueError(f"bucket_cap_mb must be a number between 1/1024 and 4096, not {bucket_cap_mb!r}")
    if op not in (_ftf.Average, _ftf.Sum):
        raise ValueError(f"op must be Average or Sum for gradients, not {op!r}")


class _Settings:
    def __init__(self, compression, backward_passes_per_step, average_aggregated_gradients,
                 gradient_predivide_factor, bucket_cap_mb, op):
        self.compression = compression
        self.k = backward_passes_per_step
        self.average_aggregated = bool(average_aggregated_gradients)
        self.predivide = float(gradient_predivide_factor)
        self.bucket_cap_mb = bucket_cap_mb
        self.op = op

    def config(self):
        return {"compression": self.compression, "backward_passes_per_step": self.k,
                "average_aggregated_gradients": self.average_aggregated,
                "gradient_predivide_factor": self.predivide, "bucket_cap_mb": self.bucket_cap_mb,
                "op": self.op}


def _dtype(v):
    d = getattr(v, "dtype", "float32")
    return tf.as_dtype(d if not hasattr(d, "as_numpy_dtype") else d.name)


def _reduce(settings: _Settings, grads, variables):
    if _fx.size() == 1:
        return list(grads)  # one rank: nothing to reduce (Average and Sum, with any predivide factor, are the identity)
    return _ftf.reduce_gradients(grads, variables, op=settings.op, compression=settings.compression,
                                 gradient_predivide_factor=settings.predivide, bucket_cap_mb=settings.bucket_cap_mb,
                                 prefix="DistributedOptimizer")


def accumulate_and_apply(settings: _Settings, passes, accs, grads, variables, apply) -> None:
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
        apply(_reduce(settings, local, variables))
        for a in accs:
            a.assign(tf.zeros_like(a))
        return tf.constant(True)

    if tf.executing_eagerly():
        if int(passes.numpy()) % k == 0:
            reduce_and_apply()
        return
    graph = tf.compat.v1.get_default_graph()
    _ftf._chained(graph, lambda: tf.cond(tf.equal(passes % k, 0), reduce_and_apply, lambda: tf.constant(False)))


def _called_from_foreign_loss_scaler(opt) -> bool:
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, keras.optimizers.LossScaleOptimizer) and not getattr(obj, _WRAPPED, False) \
                and getattr(obj, "inner_optimizer", None) is opt:
            return True
        f = f.f_back
    return False


_xla_warned = False


def _uses_fastxfer(model) -> bool:
    opt = getattr(model, "optimizer", None)
    return getattr(opt, _WRAPPED, False) or getattr(getattr(opt, "inner_optimizer", None), _WRAPPED, False)


def _no_xla_for(model) -> None:
    """The reduction runs on the host, outside XLA: build the model's training step without XLA
    (Keras turns jit_compile on by itself on GPU machines: jit_compile="auto")."""
    global _xla_warned
    if not (_uses_fastxfer(model) and getattr(model, "jit_compile", False)):
        return
    model.jit_compile = False
    if not _xla_warned and _fx.is_initialized() and _fx.rank() == 0:
        warnings.warn("fastxfer: this model's training step runs without XLA (jit_compile=False): fastxfer's "
                      "gradient reduction runs on the host and cannot be compiled by XLA.", stacklevel=3)
    _xla_warned = True


def install_trainer_hook() -> None:
    """Wrap Keras's TensorFlowTrainer.make_train_function once: for models whose optimizer is a
    fastxfer DistributedOptimizer, turn jit_compile off before the training step is traced. Other
    models are untouched."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original = TensorFlowTrainer.make_train_function
    if getattr(original, "_fastxfer_hook", False):
        return

    def make_train_function(self, force=False):
        _no_xla_for(self)
        return original(self, force=force)

    make_train_function._fastxfer_hook = True
    make_train_function.__doc__ = original.__doc__
    TensorFlowTrainer.make_train_function = make_train_function


class _DistributedMixin:
    """Methods that the run-time subclass puts in front of the wrapped optimizer's class."""

    def build(self, variables):
        super().build(variables)
        s = self._fastxfer
        if s.k > 1:
            # Local accumulators for backward_passes_per_step. Kept out of the optimizer's tracked
            # variables (set through __dict__): a saved model reloads with the plain optimizer,
            # whose variable list must match; a partial accumulation is transient anyway.
            with tf.init_scope():
                self.__dict__["_fastxfer_acc"] = [
                    tf.Variable(tf.zeros(v.shape, _dtype(v)), trainable=False, name="fastxfer_accumulator")
                    for v in variables]
                self.__dict__["_fastxfer_passes"] = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                                                name="fastxfer_passes")

    def apply(self, grads, trainable_variables=None):
        if _called_from_foreign_loss_scaler(self):
            raise FastxferError(
                "Keras wrapped fastxfer's DistributedOptimizer in its own LossScaleOptimizer (mixed_float16), which "
                "would decide to skip a step on each rank separately, before the gradients are reduced. Create the "
                "DistributedOptimizer after keras.mixed_precision.set_global_policy('mixed_float16') (it then scales "
                "the loss itself), or pass it a keras.optimizers.LossScaleOptimizer.")
        if trainable_variables is None:
            if not self.built:
                raise ValueError("apply() without variables needs a built optimizer: call build(variables) first")
            trainable_variables = self._trainable_variables
        variables = list(trainable_variables)
        grads = list(grads)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        s = self._fastxfer
        if s.k == 1:
            return super().apply(_reduce(s, grads, variables), variables)
        return self._fastxfer_apply_accumulated(grads, variables)

    def _fastxfer_apply_accumulated(self, grads, variables):
        accs = [self._fastxfer_acc[self._get_variable_index(v)] for v in variables]
        accumulate_and_apply(self._fastxfer, self._fastxfer_passes, accs, grads, variables,
                             lambda reduced: super(_DistributedMixin, self).apply(reduced, variables))

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        fx_config = config.pop("fastxfer", None) or {}
        base = cls.__mro__[2]  # the wrapped class (cls -> mixin -> base)
        inner = base.from_config(config, custom_objects=custom_objects) if custom_objects else base.from_config(config)
        from fastxfer.keras import DistributedOptimizer

        return DistributedOptimizer(inner, **fx_config)


class _DistributedLossScaleMixin:
    """For keras.optimizers.LossScaleOptimizer: reduce the (scaled) gradients before the finite
    check, so every rank sees the same sum and skips or applies the step together."""

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self.inner_optimizer._trainable_variables
        variables = list(trainable_variables)
        return super().apply(_reduce(self._fastxfer, list(grads), variables), variables)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        fx_config = config.pop("fastxfer", None) or {}
        inner = keras.optimizers.LossScaleOptimizer.from_config(config, custom_objects=custom_objects)
        from fastxfer.keras import DistributedOptimizer

        return DistributedOptimizer(inner, **fx_config)


_classes: dict[type, type] = {}


def _distributed_class(base: type, mixin: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (mixin, base), {"__module__": base.__module__, _WRAPPED: True,
                                                    "__doc__": f"{base.__name__} reducing gradients with fastxfer."})
        _classes[base] = cls
    return cls


def distributed_keras3(optimizer, settings: _Settings):
    if getattr(optimizer, _WRAPPED, False):
        raise ValueError("this optimizer is already a fastxfer DistributedOptimizer")
    if getattr(optimizer, "built", False):
        raise ValueError("wrap the optimizer before it is built (before model.fit or apply_gradients ran with it)")
    lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if not lso and keras.config.dtype_policy().name == "mixed_float16":
        # Keras would wrap us in its LossScaleOptimizer at compile(); wrap first, distributed
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        lso = True
    if lso:
        if settings.k != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported with loss scaling (mixed_float16): "
                             "use mixed_bfloat16, which needs no loss scaling, or backward_passes_per_step=1")
        if getattr(optimizer.inner_optimizer, _WRAPPED, False):
            raise ValueError("pass the plain optimizer inside the LossScaleOptimizer, not a DistributedOptimizer")
        cls = _distributed_class(type(optimizer), _DistributedLossScaleMixin)
    else:
        cls = _distributed_class(type(optimizer), _DistributedMixin)
    # The optimizer object itself becomes distributed (its class is swapped): rebuilding it from
    # its config would lose what the config does not hold (exclude_from_weight_decay, callables,
    # unregistered schedules) and fail for custom classes.
    optimizer.__class__ = cls
    optimizer._fastxfer = settings
    return optimizer


def wrap_in_place(optimizer, settings: _Settings):
    """Make an existing (possibly built, e.g. restored) Keras 3 optimizer distributed, keeping its
    state: its class becomes the distributed subclass."""
    lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if settings.k != 1:
        raise ValueError("wrap_in_place supports backward_passes_per_step=1 only")
    optimizer.__class__ = _distributed_class(type(optimizer), _DistributedLossScaleMixin if lso else _DistributedMixin)
    optimizer._fastxfer = settings
    return optimizer
