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
