"""Elastic training for TensorFlow (Horovod's ``horovod.tensorflow.elastic``): states that hold
tf.Variables or a Keras model with its optimizer, and ``run``.

The mechanism (commit, restore, re-forming the group, sync from rank 0) is fastxfer/elastic.py's;
this module says how TensorFlow state is saved (a numpy copy of every variable), restored
(assigned back) and synced (broadcast_variables from rank 0).

A TensorFlow op that fails because a peer died raises a tf.errors.AbortedError whose message
starts "PeerFailureError:"; ``run`` treats it as the failure it is.
"""

from __future__ import annotations

import numpy as np

from fastxfer import elastic as _elastic
from fastxfer.elastic import HostsUpdatedInterrupt, ObjectState, State
from fastxfer.tensorflow.functions import broadcast_variables


def _values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables, values) -> None:
    for v, x in zip(variables, values):
        v.assign(x)


class TensorFlowState(ObjectState):
    """tf.Variables (``variables=``, e.g. a model's) plus picklable values as attributes."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError("TensorFlowState(session=...): TF1 sessions are not supported (TensorFlow 2 only)")
        self.variables = list(variables or [])
        self._saved_values = _values(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        self._saved_values = _values(self.variables)
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_values)
        super().restore()

    def sync(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, root_rank=0, name="elastic.variables")
            self._saved_values = _values(self.variables)
        super().sync()


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    vs = optimizer.variables
    return list(vs() if callable(vs) else vs)


def _optimizer_built(optimizer) -> bool:
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def _weights(model) -> list:
    """The model's weights; [] before it is built (tf-keras raises ValueError then)."""
    if not getattr(model, "built", False):
        return []
    try:
        return list(model.weights)
    except ValueError:
        return []


def _input_shape(model):
    """A built model's input shape (batch dimension None), else None."""
    if not _weights(model):
        return None
    try:
        shape = model.input_shape
    except (AttributeError, ValueError):
        return None
    return tuple(shape) if isinstance(shape, (tuple, list)) and all(
        d is None or isinstance(d, int) for d in shape) else None


class TensorFlowKerasState(ObjectState):
    """A Keras model (Keras 3 or tf-keras), its optimizer (default: the model's) and picklable
    values as attributes: ``KerasState(model, epoch=0, batch=0)``.

    sync() builds what a rank lacks before it broadcasts: the model from rank 0's input shape (a
    worker that joins late, or a Sequential that its first batch builds, as in Horovod's
    examples), the optimizer's slots (a worker that has not trained a step), so every rank
    broadcasts the same variables. When rank 0's model itself is not built yet, the weights follow
    at the first commit after the first batch (CommitStateCallback), as Horovod's broadcast
    callback does for such models. After a reset, the model's traced train/test/predict functions
    are dropped: they were traced for the old group's size."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.pending_sync = False  # rank 0's model was not built at the last sync (see above)
        self._saved_model = _values(_weights(self.model))
        self._saved_optimizer = _values(self._optimizer_state())
        super().__init__(**kwargs)

    def _optimizer_state(self) -> list:
        """The optimizer's variables that are state (fastxfer.keras's KerasState leaves out
        backward_passes_per_step's accumulators: this rank's own partial gradients)."""
        return _optimizer_variables(self.optimizer)

    def _build_like_rank_0(self) -> bool:
        """Build the model (and the optimizer) where rank 0's is built; whether rank 0's is."""
        from fastxfer import comm

        shape = _input_shape(self.model)
        if comm.size() > 1:
            shape = comm.broadcast_object(shape, root=0, name="elastic.model_shape")
        if shape is None:
            return False
        if not _weights(self.model):
            self.model.build(shape)
        opt = self.optimizer
        if opt is not None and not _optimizer_built(opt):
            opt.build(self.model.trainable_variables)
        return True

    def save(self) -> None:
        self._saved_model = _values(_weights(self.model))
        self._saved_optimizer = _values(self._optimizer_state())
        super().save()

    def restore(self) -> None:
        weights = _weights(self.model)
        if len(weights) == len(self._saved_model):
            _assign(weights, self._saved_model)
        ovs = self._optimizer_state()
        if len(ovs) == len(self._saved_optimizer):
            _assign(ovs, self._saved_optimizer)
        super().restore()

    def sync(self) -> None:
        self.pending_sync = not self._build_like_rank_0()
        if not self.pending_sync:
            broadcast_variables(_weights(self.model), root_rank=0, name="elastic.model")
            ovs = self._optimizer_state()
            if ovs:
                broadcast_variables(ovs, root_rank=0, name="elastic.optimizer")
        self._saved_model = _values(_weights(self.model))
        self._saved_optimizer = _values(self._optimizer_state())
        super().sync()

    def commit(self) -> None:
        if self.pending_sync:  # rank 0's model was built by the first batch since: sync it now
            self.sync()
        super().commit()

    def reset(self) -> None:
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, attr):
                setattr(self.model, attr, None)


def run(func):
    """Decorator: run ``func(state, ...)`` elastically (fastxfer/elastic.py)."""
    return _elastic.run(func)


__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]
