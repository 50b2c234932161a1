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

from fastxfer import FastxferError, MismatchError, PeerFailureError
from fastxfer.keras import _optimizer, callbacks, optimizers, schedules
from fastxfer.keras._layers import SyncBatchNormalization
from fastxfer.keras._optimizer import DistributedOptimizer, load_model
from fastxfer.keras.optimizers import LARS, RMSpropToSGD
from fastxfer.keras.schedules import scale_lr
from fastxfer.tensorflow import (Average, Compression, Max, Min, Sum, allgather, allreduce, broadcast, broadcast_object,
                                 broadcast_variables, grouped_allreduce, init, is_initialized, local_rank, local_size,
                                 oob_allreduce, rank, shutdown, size)

# model.fit of a model with a DistributedOptimizer must trace its training step without XLA
_optimizer.install_trainer_hook()

__all__ = ["Average", "Compression", "DistributedOptimizer", "FastxferError", "LARS", "RMSpropToSGD", "optimizers",
           "scale_lr", "schedules", "Max", "Min", "MismatchError",
           "PeerFailureError", "Sum", "SyncBatchNormalization", "allgather", "allreduce", "broadcast",
           "broadcast_object", "broadcast_variables", "callbacks", "grouped_allreduce", "init", "is_initialized",
           "load_model", "local_rank", "local_size", "oob_allreduce", "rank", "shutdown", "size"]
