"""SyncBatchNormalization: batch statistics computed over every worker's batch."""

from __future__ import annotations

import keras
import tensorflow as tf

import fastxfer as _fx
import fastxfer.tensorflow as _ftf


def _allreduce_sum_differentiable(x: tf.Tensor) -> tf.Tensor:
    """Sum over ranks whose gradient is again the sum over ranks: each rank's loss depends on
    every rank's statistics, so rank r's input receives the sum of all ranks' upstream gradients."""

    @tf.custom_gradient
    def f(t):
        y = _ftf.allreduce(t, op=_ftf.Sum)

        def grad(dy):
            return _ftf.allreduce(dy, op=_ftf.Sum)

        return y, grad

    return f(x)


@keras.saving.register_keras_serializable(package="fastxfer")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training-time mean and variance are those of the
    global batch (all workers' samples together), as if one worker ran the concatenated batch.

    Each call reduces one small vector per layer (count, per-channel sum and sum of squares)
    across ranks; the backward pass reduces its gradient the same way. Moving statistics are
    updated from the global moments, so they stay identical on every rank. Inference and a
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
        axes = self._reduction_axes
        x = tf.convert_to_tensor(inputs)
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
            s = tf.reduce_sum(x, axis=axes)
            q = tf.reduce_sum(tf.square(x), axis=axes)
        else:
            w = tf.cast(tf.broadcast_to(tf.expand_dims(tf.cast(mask, x.dtype), -1), tf.shape(x)), x.dtype)
            count = tf.reduce_sum(w) / tf.cast(tf.shape(x)[-1], x.dtype)
            s = tf.reduce_sum(x * w, axis=axes)
            q = tf.reduce_sum(tf.square(x) * w, axis=axes)
        stats = tf.concat([tf.reshape(count, [1]), s, q], axis=0)
        total = _allreduce_sum_differentiable(stats)
        c = tf.shape(s)[0]
        n = total[0]
        mean = total[1:1 + c] / n
        # E[x^2] - mean^2 (as tf.distribute's synchronised batch norm does), clamped at 0
        variance = tf.maximum(total[1 + c:] / n - tf.square(mean), 0.0)
        return mean, variance

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config
