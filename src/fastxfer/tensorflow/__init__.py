"""Horovod-style TensorFlow API on fastxfer: collectives on tf.Tensors (eager and inside
tf.function), DistributedGradientTape and broadcast_variables.

Modules: ``ops`` (the collectives: submit/wait ops, their order in a traced graph, op and
compression names), ``overlap`` (pinning gradient submits into the backward pass), ``tape``
(DistributedGradientTape, reduce_gradients), ``functions`` (variables and Python objects).
Design notes: docs/tensorflow.md.
"""

from fastxfer import (FastxferError, MismatchError, PeerFailureError, init, is_initialized, local_rank, local_size,
                      rank, shutdown, size)
from fastxfer.tensorflow import ops
from fastxfer.tensorflow.functions import broadcast_object, broadcast_variables
from fastxfer.tensorflow.ops import (Average, Compression, Max, Min, Sum, allgather, allreduce, broadcast,
                                     grouped_allreduce, in_xla_context, oob_allreduce)
from fastxfer.tensorflow.tape import DistributedGradientTape, reduce_gradients


def __getattr__(name):
    # `submitted` is a live counter (collectives handed to the engine so far): read it afresh each time
    if name == "submitted":
        return ops.submitted_count()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Average", "Compression", "DistributedGradientTape", "FastxferError", "Max", "Min", "MismatchError",
           "PeerFailureError", "Sum", "allgather", "allreduce", "broadcast", "broadcast_object", "broadcast_variables",
           "grouped_allreduce", "in_xla_context", "init", "is_initialized", "local_rank", "local_size",
           "oob_allreduce", "rank", "reduce_gradients", "shutdown", "size"]
