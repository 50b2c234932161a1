"""DistributedOptimizer for tf-keras 2.x optimizers (``TF_USE_LEGACY_KERAS=1``, ``import tf_keras``).

tf-keras's ``Model.train_step`` calls ``optimizer.minimize`` -> ``apply_gradients(grads_and_vars)``;
the run-time subclass reduces the gradients there, before the wrapped class's own
``apply_gradients``. Under mixed_float16 the optimizer is a ``LossScaleOptimizer`` whose
``apply_gradients`` is likewise preceded by the reduction, so every rank sees the same (scaled)
sum before deciding whether the step is finite.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from fastxfer.tensorflow.distributed_optimizer import (ACCUMULATORS, PASSES, accumulate_and_apply, distributed_class, is_distributed,
                                         new_settings, reduce_gradients)


class _LegacyMixin:
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        s = self._fastxfer
        if s.k == 1:
            reduced = reduce_gradients(s, grads, variables)
            return super().apply_gradients(list(zip(reduced, variables)), *args, **kwargs)
        accs = self._fastxfer_accumulators(variables)
        accumulate_and_apply(
            s, self.__dict__[PASSES], accs, grads, variables,
            lambda reduced: super(_LegacyMixin, self).apply_gradients(list(zip(reduced, variables)), *args, **kwargs))
        return self.iterations

    def _fastxfer_accumulators(self, variables):
        store = self.__dict__.setdefault(ACCUMULATORS, {})
        with tf.init_scope():
            if PASSES not in self.__dict__:
                self.__dict__[PASSES] = tf.Variable(0, dtype=tf.int64, trainable=False, name="fastxfer_passes")
            for v in variables:
                key = id(v)
                if key not in store:
                    store[key] = tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                             name="fastxfer_accumulator")
        return [store[id(v)] for v in variables]

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # a copy built from a config is distributed too (with the default settings: the config
        # is the wrapped class's and holds none of fastxfer's)
        config = dict(config)  # from_config may deserialize entries in place: not in the caller's dict
        base = cls._fastxfer_base  # the wrapped class
        return distributed_legacy(base.from_config(config, custom_objects=custom_objects), new_settings())


def is_legacy_optimizer(optimizer) -> bool:
    return isinstance(optimizer, (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer,
                                  tf_keras.mixed_precision.LossScaleOptimizer))


def distributed_legacy(optimizer, settings):
    if is_distributed(optimizer):
        raise ValueError("this optimizer is already a fastxfer DistributedOptimizer")
    lso_types = (tf_keras.mixed_precision.LossScaleOptimizer,)
    if not isinstance(optimizer, lso_types) and tf_keras.mixed_precision.global_policy().name == "mixed_float16":
        optimizer = tf_keras.mixed_precision.LossScaleOptimizer(optimizer)
    if isinstance(optimizer, lso_types) and settings.k != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported with loss scaling (mixed_float16)")
    # in place: keeps what a config round trip would lose
    optimizer.__class__ = distributed_class(type(optimizer), _LegacyMixin)
    optimizer._fastxfer = settings
    return optimizer
