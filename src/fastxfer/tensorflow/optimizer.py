"""``fastxfer.tensorflow.DistributedOptimizer``: Horovod's TensorFlow entry point for optimizers.

Keras optimizers (Keras 3 or tf-keras) go to keras_optimizer.py (which fastxfer.keras exports
too), as Horovod's do. TensorFlow 1 optimizers (``tf.compat.v1.train.Optimizer``, used with sessions) are not
supported: use a Keras optimizer with DistributedGradientTape or DistributedOptimizer."""

from __future__ import annotations

import tensorflow as tf

from fastxfer.tensorflow.basics import global_process_set
from fastxfer.tensorflow.compression import Compression
from fastxfer.tensorflow.ops import Average


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so that it averages gradients across ranks (Horovod's signature for
    horovod.tensorflow.DistributedOptimizer; the work is keras_optimizer.DistributedOptimizer's)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError("DistributedOptimizer: TensorFlow 1 optimizers (tf.compat.v1.train.*) are not "
                                  "supported by fastxfer; use a Keras optimizer (tf.keras.optimizers.*) with "
                                  "DistributedGradientTape, or fastxfer.keras.DistributedOptimizer")
    # keras is imported when a Keras optimizer is first wrapped, not with this package
    from fastxfer.tensorflow.keras_optimizer import DistributedOptimizer as keras_distributed

    return keras_distributed(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                             compression=compression, sparse_as_dense=sparse_as_dense,
                             gradient_predivide_factor=gradient_predivide_factor, op=op,
                             backward_passes_per_step=backward_passes_per_step,
                             average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                             groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
