"""Horovod's Keras-level collectives (``horovod.tensorflow.keras.allreduce`` & co.): they take any
tensor-compatible value and return a tensor, with the Keras module's signatures (``name`` before
``average`` in allreduce), over fastxfer.tensorflow's."""

from __future__ import annotations

import tensorflow as tf

from fastxfer.tensorflow import api
from fastxfer.tensorflow.compression import Compression

__all__ = ["allgather", "allreduce", "broadcast", "reducescatter"]


@tf.autograph.experimental.do_not_convert
def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce a tensor-compatible value across ranks (Horovod's Keras signature): Average by default
    (``op``; the deprecated ``average`` still works). Returns a tensor."""
    return api.allreduce(tf.convert_to_tensor(value), average=average, op=op, compression=compression, name=name,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor)


@tf.autograph.experimental.do_not_convert
def allgather(value, name=None):
    """Concatenate every rank's value along the first dimension (sizes may differ). Returns a tensor."""
    return api.allgather(tf.convert_to_tensor(value), name=name)


@tf.autograph.experimental.do_not_convert
def broadcast(value, root_rank=0, name=None):
    """root_rank's value on every rank. Returns a tensor."""
    return api.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


@tf.autograph.experimental.do_not_convert
def reducescatter(value, name=None, op=api.Average):
    """Horovod's Keras reducescatter: fastxfer.tensorflow.reducescatter when this build has it."""
    return api.reducescatter(tf.convert_to_tensor(value), name=name, op=op)
