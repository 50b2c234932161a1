"""The exceptions fastxfer.tensorflow raises eagerly: each is both fastxfer's own class and the
``tf.errors`` class Horovod's TensorFlow ops raise for the same failure, so a script written for
either catches it:

==========================  ======================================  ===============================
fastxfer.tensorflow         fastxfer class (``except fx.X``)         TensorFlow class (Horovod's)
==========================  ======================================  ===============================
``MismatchError``           ``fastxfer.MismatchError``               ``tf.errors.FailedPreconditionError``
``InvalidArgumentError``    ``ValueError``                           ``tf.errors.InvalidArgumentError``
==========================  ======================================  ===============================

Inside a ``tf.function`` TensorFlow itself raises the op's error, of the ``tf.errors`` class alone
(its message starts with fastxfer's class name, ``MismatchError: ...``): Python matches an
``except`` clause by the exception's type, which TensorFlow picks from the op's status code, so
only the TensorFlow clause catches it there -- as in Horovod. ``translate`` turns such an error into
the class above.
"""

from __future__ import annotations

import re

import tensorflow as tf

from fastxfer import errors


class MismatchError(errors.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagreed on a collective (shape, dtype, op, options, kind): it failed on every rank
    that submitted it, and the next collective works."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """A collective's arguments are wrong on this rank (splits that do not add up, say)."""

    def __init__(self, message: str):
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


__all__ = ["InvalidArgumentError", "MismatchError", "translate"]
