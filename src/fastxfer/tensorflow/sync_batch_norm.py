"""SyncBatchNormalization: batch statistics computed over every worker's batch."""

from __future__ import annotations

import keras
import tensorflow as tf

import fastxfer as _fx
from fastxfer.tensorflow import api


def _allreduce_sum_differentiable(x: tf.Tensor) -> tf.Tensor:
    """Sum over ranks whose gradient is again the sum over ranks: each rank's loss depends on
    every rank's statistics, so rank r's input receives the sum of all ranks' upstream gradients."""

    @tf.custom_gradient
    def f(t):
        y = api.allreduce(t, op=api.Sum)

        def grad(dy):
            return api.allreduce(dy, op=api.Sum)

        return y, grad

    return f(x)


def global_moments(moving_mean, inputs, axes, mask):
    """Mean and variance of `inputs` over `axes` and over every rank's batch (shape: the kept
    axes). Each rank reduces one small vector: count, per-channel sums of x - c and of (x - c)^2,
    with c the moving mean, which is the same on every rank -- broadcast at the start, then
    updated from global moments -- so E[x^2] - E[x]^2 does not cancel when |mean| >> std. The
    backward pass reduces its gradient the same way. `mask` (optional) weighs samples as Keras does."""
    x = tf.convert_to_tensor(inputs)
    axes = list(axes)
    c = tf.cast(tf.reshape(moving_mean, [-1]), x.dtype)
    keep = [i for i in range(len(x.shape)) if i not in axes]
    shape = [1] * len(x.shape)
    for i in keep:
        shape[i] = x.shape[i]
    d = x - tf.reshape(c, shape)
    if mask is None:
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
    else:
        w = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(x))
        d = tf.where(w, d, tf.zeros_like(d))  # masked positions contribute nothing, even NaN
        count = tf.reduce_sum(tf.cast(w, x.dtype)) / tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), keep)), x.dtype)
    # sums in float64: the shift is only as good as the moving mean (0 at the first step)
    d64 = tf.cast(d, tf.float64)
    s = tf.reshape(tf.reduce_sum(d64, axis=axes), [-1])
    q = tf.reshape(tf.reduce_sum(tf.square(d64), axis=axes), [-1])
    total = _allreduce_sum_differentiable(tf.concat([tf.reshape(tf.cast(count, tf.float64), [1]), s, q], axis=0))
    k = tf.shape(s)[0]
    n = total[0]
    dm = total[1:1 + k] / n
    variance = tf.cast(tf.maximum(total[1 + k:] / n - tf.square(dm), 0.0), x.dtype)
    mean = c + tf.cast(dm, x.dtype)
    stat_shape = [x.shape[i] for i in keep]
    return tf.reshape(mean, stat_shape), tf.reshape(variance, stat_shape)


@keras.saving.register_keras_serializable(package="fastxfer")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training-time mean and variance are those of the
    global batch (all workers' samples together), as if one worker ran the concatenated batch.

    Each call reduces one small vector per layer across ranks (global_moments); moving statistics
    are updated from the global moments, so they stay identical on every rank. Inference and a
    single-rank job behave exactly like BatchNormalization. Same arguments as BatchNormalization
    (``synchronized`` is refused: that is the tf.distribute mechanism this layer replaces).
    """

    def __init__(self, *args, **kwargs):
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronises through fastxfer; do not pass synchronized=True")
        kwargs.pop("synchronized", None)
        super().__init__(*args, **kwargs)

    def _moments(self, inputs, mask):
        if not _fx.is_initialized() or _fx.size() == 1:
            return super()._moments(inputs, mask)
        return global_moments(self.moving_mean, inputs, self._reduction_axes, mask)

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config


def tf_keras_sync_batch_normalization():
    """The same layer for tf-keras models (TF_USE_LEGACY_KERAS=1): a tf_keras BatchNormalization
    whose non-fused path takes its batch moments from global_moments (fused batch norm computes
    them inside one kernel, so the layer is never fused, as Horovod's)."""
    import tf_keras

    @tf_keras.utils.register_keras_serializable(package="fastxfer")
    class SyncBatchNormalization(tf_keras.layers.BatchNormalization):  # noqa: F811 - the tf-keras twin
        """tf_keras.layers.BatchNormalization with the global batch's statistics (see fastxfer.keras)."""

        def __init__(self, *args, **kwargs):
            if kwargs.get("synchronized"):
                raise ValueError("SyncBatchNormalization synchronises through fastxfer; do not pass synchronized=True")
            if kwargs.get("fused"):
                raise ValueError("SyncBatchNormalization cannot be fused (the fused kernel computes the moments "
                                 "of this rank's batch only)")
            kwargs.pop("synchronized", None)
            kwargs["fused"] = False
            super().__init__(*args, **kwargs)

        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            if not _fx.is_initialized() or _fx.size() == 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            mean, variance = global_moments(self.moving_mean, inputs, reduction_axes, mask)
            if keep_dims:
                shape = [1 if i in reduction_axes else inputs.shape[i] for i in range(len(inputs.shape))]
                mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
            return mean, variance

        def get_config(self):
            config = super().get_config()
            config.pop("synchronized", None)
            config.pop("fused", None)
            return config

    return SyncBatchNormalization
