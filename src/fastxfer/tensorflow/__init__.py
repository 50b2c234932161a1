"""Horovod-style TensorFlow API on fastxfer: collectives on tf.Tensors (eager and inside
tf.function), DistributedGradientTape, broadcast_variables, and Horovod's queries.

Swap the import and a Horovod TensorFlow 2 script runs::

    import fastxfer.tensorflow as hvd           # was: import horovod.tensorflow as hvd

Modules, top-down as a collective flows: ``api`` (Horovod's signatures: builds each call's
CollectiveOptions once; deprecated ``average=``, sparse tensors), ``ops`` (the collectives on
tensors given their options: naming, grouping, holds, gradients), ``backend`` (the one seam to the
engine: ``submit``/``wait``, native ops or the numpy_function bridge, trace order),
``compression`` (Compressor, Compression), ``basics`` (rank and
capability queries, timeline, process sets), ``overlap`` (pinning gradient submits into the
backward pass), ``tape`` (DistributedGradientTape, PartialDistributedGradientTape,
reduce_gradients), ``functions`` (variables and Python objects). Design notes and the table of
every Horovod name: docs/tensorflow.md.
"""

from fastxfer import (FastxferError, MismatchError, PeerFailureError, init, is_initialized, local_rank, local_size,
                      rank, shutdown, size)
from fastxfer.tensorflow import backend, elastic
from fastxfer.tensorflow.api import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, alltoall, broadcast,
                                     broadcast_, check_num_rank_power_of_2, grouped_allgather, grouped_allreduce,
                                     grouped_reducescatter, handle_average_backwards_compatibility, join,
                                     reducescatter)
from fastxfer.tensorflow.basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                                        ddl_built, gloo_built, gloo_enabled, global_process_set, is_homogeneous,
                                        local_rank_op, local_size_op, mpi_built, mpi_enabled, mpi_threads_supported,
                                        nccl_built, process_set_included_op, rank_op, remove_process_set, rocm_built,
                                        size_op, start_timeline, stop_timeline, sycl_built)
from fastxfer.tensorflow.compression import Compression, Compressor
from fastxfer.tensorflow.functions import (allgather_object, broadcast_global_variables, broadcast_object,
                                           broadcast_object_fn, broadcast_variables)
from fastxfer.tensorflow.backend import in_xla_context
from fastxfer.tensorflow.ops import oob_allreduce
from fastxfer.tensorflow.optimizer import DistributedOptimizer
from fastxfer.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape, reduce_gradients


def __getattr__(name):
    # `submitted` is a live counter (collectives handed to the engine so far): read it afresh each time
    if name == "submitted":
        return backend.submitted_count()
    if name == "SyncBatchNormalization":
        # a Keras layer: keras is imported on first use, not with this package
        from fastxfer.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Adasum", "Average", "Compression", "Compressor", "DistributedGradientTape", "DistributedOptimizer",
           "FastxferError", "Max", "Min", "MismatchError", "PartialDistributedGradientTape", "PeerFailureError",
           "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_object", "allreduce",
           "alltoall", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "ccl_built", "check_num_rank_power_of_2", "cross_rank",
           "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
           "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
           "handle_average_backwards_compatibility", "in_xla_context", "init", "is_homogeneous", "is_initialized",
           "join", "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "oob_allreduce", "process_set_included_op", "rank", "rank_op",
           "reduce_gradients", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
           "start_timeline", "stop_timeline", "sycl_built"]
