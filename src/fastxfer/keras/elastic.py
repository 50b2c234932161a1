"""Elastic training for Keras (Horovod's ``horovod.tensorflow.keras.elastic``): ``KerasState``, the
callbacks that keep it current during ``model.fit``, and ``run``. Keras 3, or tf-keras when
``TF_USE_LEGACY_KERAS=1`` is set before the import. A Horovod elastic Keras script runs with only
its import changed::

    import fastxfer.keras as hvd

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: scale the learning rate by hvd.size()])
    callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

``state.batch`` counts the batches of the current epoch done so far (Horovod keeps the index of the
last one; counting makes the resumed epoch exact). After a reset in the middle of an epoch the
first epoch of the new ``fit`` ends once the epoch's remaining batches are done
(UpdateBatchStateCallback), so every epoch trains ``steps_per_epoch`` batches in all.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":  # tf.keras is tf-keras: its models call its callbacks
    import tf_keras as keras
else:
    import keras

from fastxfer.elastic import HostsUpdatedInterrupt, ObjectState, State
from fastxfer.tensorflow.distributed_optimizer import accumulators
from fastxfer.tensorflow.elastic import TensorFlowKerasState, TensorFlowState, run
from fastxfer.log import logger


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer and picklable values (``KerasState(model, batch=0, epoch=0)``)."""

    def _optimizer_state(self) -> list:
        # backward_passes_per_step's accumulators hold this rank's own gradients: not state
        skip = {id(v) for v in accumulators(self.optimizer)} if self.optimizer is not None else set()
        return [v for v in super()._optimizer_state() if id(v) not in skip]


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at every epoch's end.

    The commit is made when the next batch (or epoch) begins, after every callback has seen the
    batch's end, so the state it saves has the batch and epoch counters of the weights it saves,
    whatever the order of the callbacks (Horovod's examples put this one first)."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, not {batches_per_commit}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._remaining = self.batches_per_commit
        self._due = False

    def _commit_if_due(self):
        if self._due:
            self._due = False
            self.state.commit()

    def on_train_begin(self, logs=None):
        self._due = False
        self._remaining = self.batches_per_commit

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_train_batch_end(self, batch, logs=None):
        self._remaining -= 1
        if self._remaining == 0:
            self._remaining = self.batches_per_commit
            self._due = True

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._remaining = self.batches_per_commit
        self._due = True


def _fit_loop_state():
    """The running fit's epoch iterator (Keras 3: ``epoch_iterator``) or data handler (tf-keras:
    ``data_handler``), found in fit's frame; None when neither is there."""
    f = sys._getframe(1)
    while f is not None:
        for name in ("epoch_iterator", "data_handler"):
            obj = f.f_locals.get(name)
            if obj is not None and hasattr(obj, "catch_stop_iteration"):
                return obj
        f = f.f_back
    return None


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` = batches of the current epoch done, and ends a resumed epoch when its
    remaining batches are done.

    Ending an epoch early: the callback raises StopIteration after the epoch's last batch, which
    ``fit`` takes as the end of the epoch's data (Keras 3 and tf-keras alike); at the epoch's end
    it clears what fit noted of it (Keras 3's epoch iterator would keep the short length for the
    later epochs, tf-keras's data handler would stop training), and the misleading "ran out of
    data" warning is filtered meanwhile. Horovod changes ``params['steps']`` instead, which neither
    Keras 3 nor tf-keras 2.21 reads."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._offset = 0
        self._steps = None
        self._ended_early = False
        self._filter = None

    def on_train_begin(self, logs=None):
        self._steps = (self.params or {}).get("steps")
        self._unfilter()  # a fit that a failure ended right after an early epoch end

    def _unfilter(self) -> None:
        """Undo the warning filter and the logger level set when an epoch was ended early."""
        if self._filter is None:
            return
        logging.getLogger("tensorflow").setLevel(self._logger_level)
        try:
            warnings.filters.remove(self._filter)
            warnings._filters_mutated()
        except (ValueError, AttributeError):
            pass
        self._filter = None

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = int(getattr(self.state, "batch", 0) or 0)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        if self._offset and self._steps and self.state.batch >= self._steps:
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            self._filter = warnings.filters[0]
            self._logger_level = logging.getLogger("tensorflow").level
            logging.getLogger("tensorflow").setLevel(logging.ERROR)  # tf-keras warns through absl/logging
            self._ended_early = True
            raise StopIteration

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._offset = 0
        if self._ended_early:
            self._ended_early = False
            loop = _fit_loop_state()
            if hasattr(loop, "_insufficient_data"):  # tf-keras
                loop._insufficient_data = False
            elif hasattr(loop, "data_adapter") and hasattr(loop, "_num_batches"):  # Keras 3
                loop._num_batches = loop.data_adapter.num_batches
            else:
                logger.warning("fastxfer.keras.elastic: this Keras's fit loop is not one fastxfer knows; the "
                               "epochs after a mid-epoch reset may be shorter than steps_per_epoch")
            self._unfilter()


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` = epochs done (across resets: ``fit(epochs=epochs - state.epoch)``
    counts its epochs from 0)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._initial = int(getattr(state, "epoch", 0) or 0)

    def on_train_begin(self, logs=None):
        self._initial = int(getattr(self.state, "epoch", 0) or 0)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._initial + epoch + 1


__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
