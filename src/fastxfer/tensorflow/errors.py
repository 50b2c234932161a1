"""fastxfer's process-set errors as TensorFlow raises Horovod's: each is both fastxfer's exception
(a FastxferError, caught by code written for fastxfer) and ``tf.errors.InvalidArgumentError``
(caught by code written for Horovod, whose ops fail that way for a set a rank is not in).
``tf_errors`` turns the numpy layer's exceptions into these at the TensorFlow entry points."""

from __future__ import annotations

import functools

import tensorflow as tf

from fastxfer import errors


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
