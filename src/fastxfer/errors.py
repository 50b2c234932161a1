"""Exception types shared by every fastxfer module."""


class FastxferError(RuntimeError):
    """Base class of fastxfer's own errors."""


class PeerFailureError(FastxferError):
    """A peer rank died or stopped answering."""


class MismatchError(FastxferError):
    """Ranks disagree on tensor names, shapes, dtypes, counts or order."""


class TopologyError(FastxferError):
    """A topology file (sysfs/procfs, or a --root snapshot) is missing or malformed, or the
    machine cannot host the requested workers."""


class NotInProcessSetError(FastxferError):
    """A collective called on a process set this rank is not one of (only the set's ranks run its
    collectives; DistributedGradientTape and DistributedOptimizer leave such a rank's gradients as
    they are, as Horovod does). fastxfer.tensorflow raises a subclass that is also
    tf.errors.InvalidArgumentError."""


class ProcessSetRemovedError(FastxferError, ValueError):
    """A collective (or remove_process_set) on a process set that remove_process_set removed."""
