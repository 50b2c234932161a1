"""Exception types shared by every fastxfer module."""


class FastxferError(RuntimeError):
    """Base class of fastxfer's own errors."""


class PeerFailureError(FastxferError):
    """A peer rank died or stopped answering."""


class MismatchError(FastxferError):
    """Ranks disagree on tensor names, shapes, dtypes, counts or order."""
