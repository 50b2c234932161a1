"""The exceptions fastxfer.tensorflow raises eagerly: each is both fastxfer's own class and the
``tf.errors`` class Horovod's TensorFlow ops raise for the same failure, so a script written for
either catches it:

==========================  ======================================  ===============================
fastxfer.tensorflow         fastxfer class (``except fx.X``)         TensorFlow class (Horovod's)
==========================  ======================================  ===============================
``MismatchError``           ``fastxfer.MismatchError``               ``tf.errors.FailedPreconditionError``
``InvalidArgumentError``    ``ValueError``                           ``tf.errors.InvalidArgumentError``
``NotInProcessSetError``    ``fastxfer.NotInProcessSetError``        ``tf.errors.InvalidArgumentError``
``ProcessSetRemovedError``  ``fastxfer.ProcessSetRemovedError``      ``tf.errors.InvalidArgumentError``
==========================  ======================================  ===============================

Inside a ``tf.function`` TensorFlow itself raises the op's error, of the ``tf.errors`` class alone
(its message starts with fastxfer's class name, ``MismatchError: ...``): Python matches an
``except`` clause by the exception's type, which TensorFlow picks from the op's status code, so
only the TensorFlow clause catches it there -- as in Horovod. ``translate`` turns such an error into
the class above.
"""

from __future__ import annotations

import functools
import re

import tensorflow as tf

from fastxfer import errors


class MismatchError(errors.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagreed on a collective (shape, dtype, op, options, kind): it failed on every rank
    that submitted it, and the next collective works."""

    def __init__(self, *args):
        # (message), or OpError's (node_def, op, message): AutoGraph re-creates an OpError that way
        message = args[0] if len(args) == 1 else args[2]
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """A collective's arguments are wrong on this rank (splits that do not add up, say)."""

    def __init__(self, *args):
        # (message), or OpError's (node_def, op, message): AutoGraph re-creates an OpError that way
        message = args[0] if len(args) == 1 else args[2]
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)

    def __str__(self) -> str:
        return self.message


_CLASSES = {"PeerFailureError": errors.PeerFailureError, "MismatchError": MismatchError,
            "FastxferError": errors.FastxferError, "ValueError": InvalidArgumentError}
_MESSAGE = re.compile(r"(PeerFailureError|MismatchError|FastxferError|ValueError): (.*?)(?: \[Op:\w+\])?$", re.S)


def translate(e: BaseException) -> BaseException:
    """fastxfer's exception for an error a native op (or the numpy_function bridge) raised, else
    ``e`` itself. A MismatchError or a ValueError already of the classes above is returned as is."""
    if isinstance(e, (MismatchError, InvalidArgumentError)):
        return e
    if isinstance(e, errors.MismatchError):
        return MismatchError(str(e))
    if not isinstance(e, tf.errors.OpError):
        return e
    m = _MESSAGE.search(e.message or "")
    if m is None:
        return e
    return _CLASSES[m.group(1)](m.group(2).strip())


# ---- process sets (Horovod raises InvalidArgumentError for a set a rank is not in) ----------------

class _TFProcessSetError(tf.errors.InvalidArgumentError):
    """Comes first in the bases, so that its constructor, str() and pickling win over
    RuntimeError's (fastxfer's class comes second). The constructor is InvalidArgumentError's,
    ``(node_def, op, message)`` (None, None: no op ran), because AutoGraph re-creates an OpError
    raised while a tf.function traces with exactly those arguments (adding where in the user's
    code it was raised); any other signature would turn it into AutoGraph's StagingError."""

    def __init__(self, node_def, op, message, *args):
        tf.errors.InvalidArgumentError.__init__(self, node_def, op, message, *args)
        self.args = (message,)  # OpError's __init__ leaves args empty

    def __str__(self):
        return self.message

    def __reduce__(self):
        return type(self), (None, None, self.message)


class NotInProcessSetError(_TFProcessSetError, errors.NotInProcessSetError):
    """A collective called on a process set this rank is not one of."""


class ProcessSetRemovedError(_TFProcessSetError, errors.ProcessSetRemovedError):
    """A collective called on a process set that remove_process_set removed (also a ValueError)."""


def tf_errors(fn):
    """``fn`` raising the TensorFlow kinds of the process-set errors (eagerly and while a
    tf.function traces it: the set is checked when the call is made)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (errors.NotInProcessSetError, errors.ProcessSetRemovedError) as e:
            if isinstance(e, tf.errors.OpError):
                raise
            kind = NotInProcessSetError if isinstance(e, errors.NotInProcessSetError) else ProcessSetRemovedError
            raise kind(None, None, str(e)) from None

    return call


__all__ = ["InvalidArgumentError", "MismatchError", "NotInProcessSetError", "ProcessSetRemovedError", "tf_errors",
           "translate"]
