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
    vs = list(vs() if callable(vs) else vs)
    try:  # backward_passes_per_step's accumulators hold this rank's own gradients: not state
        from fastxfer.keras._distributed import accumulators

        skip = {id(v) for v in accumulators(optimizer)}
    except ImportError:
        skip = set()
    return [v for v in vs if id(v) not in skip]


def _optimizer_built(optimizer) -> bool:
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


class TensorFlowKerasState(ObjectState):
    """A Keras model (Keras 3 or tf-keras), its optimizer (default: the model's) and picklable
    values as attributes: ``KerasState(model, epoch=0, batch=0)``.

    The model must have its weights (built, e.g. from an Input). sync() builds the optimizer when
    it has no slots yet -- a worker that joins late has not trained a step -- so that every rank
    broadcasts the same variables. After a reset, the model's traced train/test/predict functions
    are dropped: they were traced for the old group's size."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if not getattr(model, "built", False) or not model.weights:
            raise ValueError("KerasState needs a built model (its weights exist): build it (keras.Input, "
                             "model.build(shape)) before creating the state")
        self._saved_model = _values(self.model.weights)
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))
        super().__init__(**kwargs)

    def _build_optimizer(self) -> None:
        opt = self.optimizer
        if opt is not None and not _optimizer_built(opt):
            opt.build(self.model.trainable_variables)

    def save(self) -> None:
        self._saved_model = _values(self.model.weights)
        self._saved_optimizer = _values(_optimizer_variables(self.optimizer))
        super().save()

    def restore(self) -> None:
        _assign(self.model.weights, self._saved_model)
        ovs = _optimizer_variables(self.optimizer)
        if len(ovs) == len(self._saved_optimizer):
            _assign(ovs, self._saved_optimizer)
        super().restore()

    def sync(self) -> None:
        self._build_optimizer()
        broadcast_variables(self.model.weights, root_rank=0, name="elastic.model")
        ovs = _optimizer_variables(self.optimizer)
        if ovs:
            broadcast_variables(ovs, root_rank=0, name="elastic.optimizer")
        self._saved_model = _values(self.model.weights)
        self._saved_optimizer = _values(ovs)
        super().sync()

    def reset(self) -> None:
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, attr):
                setattr(self.model, attr, None)


def run(func):
    """Decorator: run ``func(state, ...)`` elastically (fastxfer/elastic.py)."""
    return _elastic.run(func)


__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]
