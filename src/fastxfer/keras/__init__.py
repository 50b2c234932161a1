"""Horovod's Keras API on fastxfer, for TensorFlow 2.21 with Keras 3 (and tf-keras 2.21).

Swap the import and an existing Horovod Keras script runs unchanged::

    import fastxfer.keras as hvd                # was: import horovod.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()), compression=hvd.Compression.bf16)
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

Design notes: docs/keras.md.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import fastxfer as _fx
from fastxfer.errors import FastxferError, MismatchError, PeerFailureError  # noqa: F401
from fastxfer.tensorflow import (Average, Compression, Max, Min, Sum, allgather, allreduce,  # noqa: F401
                                 broadcast, broadcast_object, broadcast_variables, grouped_allreduce, init,
                                 is_initialized, local_rank, local_size, rank, shutdown, size)
from fastxfer.keras import callbacks  # noqa: F401
from fastxfer.keras import optimizers, schedules  # noqa: F401
from fastxfer.keras.optimizers import LARS, RMSpropToSGD  # noqa: F401
from fastxfer.keras.schedules import scale_lr  # noqa: F401
from fastxfer.keras import _optimizer
from fastxfer.keras._layers import SyncBatchNormalization  # noqa: F401

_optimizer.install_trainer_hook()


def oob_allreduce(value, op=Average, name=None):
    """Reduce a small value (a metric, a flag) on the engine's out-of-band lane, which never waits
    behind gradient buckets. Eager only; returns a tensor of the same shape and dtype."""
    if not tf.executing_eagerly():
        raise FastxferError("oob_allreduce runs eagerly (it blocks until every rank has called it); inside a "
                            "tf.function use allreduce")
    x = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    return tf.convert_to_tensor(_fx.oob_allreduce(x, op=op, name=name))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None, bucket_cap_mb=None):
    """Wrap a Keras optimizer so that it averages gradients across ranks before applying them.

    Returns an optimizer of the same class (a run-time subclass; ``isinstance`` holds) built from
    the wrapped one's config, so wrap it before it is used. Arguments as Horovod's:

    - ``compression``: Compression.none / .bf16 / .fp16: how float32 gradients travel (reduced in
      float32 either way).
    - ``backward_passes_per_step=k``: accumulate k local gradients, reduce and apply on the k-th
      (k-times fewer reductions); ``average_aggregated_gradients`` divides the sum by k, which
      makes k passes of batch B equal one pass of batch k*B.
    - ``gradient_predivide_factor=f``: divide by f before the sum and by size/f after it.
    - ``op``: Average (default) or Sum.
    - ``bucket_cap_mb``: fusion bucket size for these gradients (default: ``init``'s, 25 MiB).
    - ``device_dense``, ``device_sparse``, ``num_groups``, ``groups`` are accepted for Horovod
      compatibility and have no effect: the engine fuses gradients into buckets by itself and
      runs on the host. Sparse gradients (IndexedSlices) are always made dense.
    - ``name``: unused (Keras 3 optimizers keep their own name).

    Under ``mixed_float16`` (set before this call) or given a LossScaleOptimizer, the result is a
    LossScaleOptimizer that reduces the scaled gradients before its finite check, so every rank
    skips or applies a step together. Keras's XLA (``jit_compile``) is turned off for the training
    step, because the reduction runs on the host.
    """
    if not _fx.is_initialized():
        raise FastxferError("call fastxfer.keras.init() before DistributedOptimizer()")
    _optimizer._check_args(compression, backward_passes_per_step, gradient_predivide_factor, bucket_cap_mb, op)
    settings = _optimizer._Settings(compression, backward_passes_per_step, average_aggregated_gradients,
                                    gradient_predivide_factor, bucket_cap_mb, op)
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer) or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return _optimizer.distributed_keras3(optimizer, settings)
    try:
        from fastxfer.keras import _legacy
    except ImportError:
        _legacy = None
    if _legacy is not None and _legacy.is_legacy_optimizer(optimizer):
        return _legacy.distributed_legacy(optimizer, settings)
    raise TypeError(f"DistributedOptimizer wraps a Keras optimizer (keras.optimizers.* or tf_keras.optimizers.*), "
                    f"not {type(optimizer).__name__}")


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, **kwargs):
    """keras.models.load_model, with the loaded optimizer wrapped in a DistributedOptimizer (the
    saved file holds the plain optimizer)."""
    import keras

    objects = dict(custom_objects or {})
    objects.setdefault("SyncBatchNormalization", SyncBatchNormalization)
    for o in custom_optimizers or []:
        objects[o.__name__] = o
    model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not getattr(opt, _optimizer._WRAPPED, False):
        settings = _optimizer._Settings(compression, 1, False, 1.0, None, Average)
        _optimizer.wrap_in_place(opt, settings)  # keeps the restored optimizer state
    return model


__all__ = ["Average", "Compression", "DistributedOptimizer", "FastxferError", "LARS", "RMSpropToSGD", "optimizers",
           "scale_lr", "schedules", "Max", "Min", "MismatchError",
           "PeerFailureError", "Sum", "SyncBatchNormalization", "allgather", "allreduce", "broadcast",
           "broadcast_object", "broadcast_variables", "callbacks", "grouped_allreduce", "init", "is_initialized",
           "load_model", "local_rank", "local_size", "oob_allreduce", "rank", "shutdown", "size"]
