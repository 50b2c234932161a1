"""Collectives on variables and Python objects: broadcast_variables, broadcast_global_variables,
broadcast_object, broadcast_object_fn, allgather_object (Horovod's signatures)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import tensorflow as tf

import fastxfer as fx
from fastxfer.comm import options
from fastxfer.comm.process_sets import resolve as resolve_process_set
from fastxfer.tensorflow import ops
from fastxfer.tensorflow.basics import global_process_set
from fastxfer.tensorflow.errors import tf_errors

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle when it is missing
    import cloudpickle as _pickle
except ImportError:  # pragma: no cover - cloudpickle ships with TensorFlow's usual environments
    import pickle as _pickle
import pickle as _unpickle

__all__ = ["allgather_object", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "broadcast_variables"]


@tf.autograph.experimental.do_not_convert  # nothing to convert; converting it slows tracing down
@tf_errors
def broadcast_variables(variables, root_rank=0, process_set=global_process_set, name=None):
    """Assign root_rank's values to ``variables`` on every rank (tf.Variable or Keras 3 Variable),
    eagerly or inside a tf.function."""
    opts = options.broadcast(root_rank, process_set)
    prefix = name or "broadcast_variables"
    assigns = []
    for i, v in enumerate(variables):
        value = v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v
        new = ops.broadcast(tf.convert_to_tensor(value), replace(opts, name=f"{prefix}.{i}"))
        assigns.append(v.assign(new))
    if not tf.executing_eagerly():  # graph mode: one op that runs every assignment, as Horovod returns
        return tf.group(*[a for a in assigns if a is not None])
    return None


def broadcast_global_variables(root_rank):
    """Horovod's TF1 call: broadcasts ``tf.compat.v1.global_variables()`` in a TF1-style graph.
    Eagerly (TensorFlow 2) it raises RuntimeError as Horovod's does: there are no global variables
    to find; broadcast the model's and the optimizer's (``broadcast_variables``, or
    ``callbacks.BroadcastGlobalVariablesCallback`` in Keras)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank, name="broadcast_global_variables")


def _words(obj) -> tuple[np.ndarray, int]:
    data = _pickle.dumps(obj)
    return np.frombuffer(data + b"\0" * (-len(data) % 8), np.int64).copy(), len(data)


@tf_errors
def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Returns root_rank's ``obj`` (any picklable object; cloudpickle when installed) on every rank.
    ``name`` names the two broadcasts it makes (it must be the same on every rank; by default they
    are numbered, the same on every rank that makes the same calls). ``session`` is TF1's and is
    ignored."""
    ps = options.broadcast(root_rank, process_set).process_set  # ValueError naming a bad root
    me = fx.rank()
    if me == root_rank:
        words, n = _words(obj)
    n = int(fx.broadcast(np.array([n if me == root_rank else 0], np.int64), root=root_rank,
                         name=None if name is None else f"{name}.sz", process_set=ps)[0])
    got = fx.broadcast(words if me == root_rank else np.zeros((n + 7) // 8, np.int64), root=root_rank,
                       name=None if name is None else f"{name}.t", process_set=ps)
    return obj if me == root_rank else _unpickle.loads(got.tobytes()[:n])


@tf_errors
def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``f(obj)`` that broadcasts ``obj`` from root_rank (Horovod's broadcast_object_fn)."""
    resolve_process_set(process_set)

    def broadcast_fn(obj):
        return broadcast_object(obj, root_rank=root_rank, session=session, name=name, process_set=process_set)

    return broadcast_fn


@tf_errors
def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """A list with every rank's ``obj``, in rank order (any picklable objects, of any sizes)."""
    ps = resolve_process_set(process_set)
    words, n = _words(obj)
    sizes = fx.allgather(np.array([n], np.int64), name=None if name is None else f"{name}.sz", process_set=ps)
    data = fx.allgather(words, name=None if name is None else f"{name}.t", process_set=ps)
    out, off = [], 0
    for size in sizes.tolist():
        k = (size + 7) // 8
        out.append(_unpickle.loads(data[off:off + k].tobytes()[:size]))
        off += k
    return out
