"""Collectives on variables and Python objects: broadcast_variables, broadcast_object."""

from __future__ import annotations

import tensorflow as tf

from fastxfer import broadcast_object
from fastxfer.tensorflow import ops

__all__ = ["broadcast_object", "broadcast_variables"]


def broadcast_variables(variables, root_rank=0):
    """Assign root_rank's values to `variables` on every rank (tf.Variable or Keras 3 Variable)."""
    for i, v in enumerate(variables):
        value = v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v
        new = ops.broadcast(tf.convert_to_tensor(value), root_rank, name=f"broadcast_variables.{i}")
        v.assign(new)
