"""Horovod's Keras API on fastxfer, for TensorFlow 2.21 with Keras 3 (and tf-keras 2.21).

Swap the import and an existing Horovod Keras script runs unchanged::

    import fastxfer.keras as hvd                # was: import horovod.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()), compression=hvd.Compression.bf16)
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

Design notes and the table of every Horovod name: docs/keras.md.
"""

import os

from fastxfer import FastxferError, MismatchError, PeerFailureError
from fastxfer.keras import callbacks, elastic, optimizers, schedules
from fastxfer.keras._collectives import allgather, allreduce, broadcast, reducescatter
from fastxfer.keras.optimizers import LARS, RMSpropToSGD
from fastxfer.keras.schedules import scale_lr
from fastxfer.tensorflow.keras_optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from fastxfer.tensorflow.sync_batch_norm import SyncBatchNormalization, tf_keras_sync_batch_normalization
from fastxfer.tensorflow import (Average, Compression, Compressor, Max, Min, Product, ProcessSet, Sum,
                                 add_process_set, allgather_object, broadcast_global_variables, broadcast_object,
                                 broadcast_object_fn, broadcast_variables, ccl_built, cross_rank, cross_size,
                                 cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set, grouped_allreduce,
                                 init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                 mpi_threads_supported, nccl_built, oob_allreduce, rank, remove_process_set,
                                 rocm_built, shutdown, size, start_timeline, stop_timeline, sycl_built)



if os.environ.get("TF_USE_LEGACY_KERAS") == "1":  # tf.keras is tf-keras: its models take its layers
    SyncBatchNormalization = tf_keras_sync_batch_normalization()  # noqa: F811

__all__ = ["Average", "Compression", "Compressor", "DistributedOptimizer", "FastxferError", "LARS", "Max", "Min",
           "MismatchError", "PartialDistributedOptimizer", "PeerFailureError", "ProcessSet", "Product",
           "RMSpropToSGD", "Sum", "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object",
           "allreduce", "broadcast", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allreduce", "init",
           "is_homogeneous", "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "oob_allreduce", "optimizers", "rank", "reducescatter",
           "remove_process_set", "rocm_built", "scale_lr", "schedules", "shutdown", "size", "start_timeline",
           "stop_timeline", "sycl_built"]
