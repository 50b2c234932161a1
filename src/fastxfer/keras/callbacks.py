"""Horovod's Keras callbacks for fastxfer: broadcast the initial state, average metrics, warm up
the learning rate, and checkpoint from rank 0 only.

They derive from Keras 3's callback classes, or from tf-keras's when ``TF_USE_LEGACY_KERAS=1`` is
set before the import (tf-keras models only call tf-keras callbacks)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import numpy as np

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":  # tf.keras is tf-keras: its models call its callbacks
    import tf_keras as keras
else:
    import keras

import fastxfer as _fx
import fastxfer.tensorflow as _ftf
from fastxfer.tensorflow.distributed_optimizer import accumulators
from fastxfer.tensorflow.tape import variable_keys


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def _built(optimizer) -> bool:
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def _optimizer_variables(optimizer) -> list:
    vs = optimizer.variables
    return list(vs() if callable(vs) else vs)


def _velocities(optimizer) -> list:
    """Momentum buffers that carry the learning rate (v = m*v - lr*g): Keras's SGD (tf-keras's
    too, also its legacy SGD) and fastxfer's LARS / RMSpropToSGD. Other optimizers' moments are not
    rescaled."""
    opt = _inner(optimizer)
    from fastxfer.keras.optimizers import LARS, RMSpropToSGD

    if isinstance(opt, (LARS, RMSpropToSGD)):
        return list(opt.velocities)
    if "SGD" in [c.__name__ for c in type(opt).__mro__]:
        momentums = getattr(opt, "momentums", None)
        if momentums is not None:
            return [m for m in momentums if m is not None]
        slots = getattr(opt, "_slots", None)  # tf-keras's legacy SGD: {variable key: {slot name: slot}}
        if isinstance(slots, dict):
            return [d["momentum"] for d in slots.values() if "momentum" in d]
    return []


def _set_lr(optimizer, value: float) -> None:
    opt = _inner(optimizer)
    lr = opt.learning_rate if hasattr(opt, "learning_rate") else opt.lr
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        opt.learning_rate = value


def _get_lr(optimizer) -> float:
    opt = _inner(optimizer)
    lr = getattr(opt, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or (callable(lr) and not hasattr(lr, "numpy")):
        raise ValueError("this callback sets the learning rate itself: give the optimizer a float learning rate, "
                         "not a schedule")
    return float(np.asarray(opt.learning_rate))


def _check_local_variables(local_variables) -> list:
    """Horovod's local_variables argument: a variable or a collection of variables (tf.Variable,
    or Keras 3's Variable)."""
    if local_variables is None:
        return []
    if _is_variable(local_variables):
        return [local_variables]
    out = list(local_variables)
    if not all(_is_variable(v) for v in out):
        raise ValueError("All local variables must be of tf.Variable type.")
    return out


def _is_variable(v) -> bool:
    import tensorflow as tf

    return isinstance(v, tf.Variable) or any(c.__name__ in ("Variable", "KerasVariable") and
                                             c.__module__.startswith(("keras.", "tf_keras."))
                                             for c in type(v).__mro__)


def _local_slot_keys(optimizer, local_vars) -> set:
    """Identities of the optimizer's slot variables (momentum, Adam moments, ...) that belong to
    ``local_vars``: they are as local as their variable. Keras 3 and tf-keras optimizers keep each
    kind of slot in a list aligned with the variables they were built with; tf-keras's legacy
    optimizers name them (get_slot)."""
    opt = _inner(optimizer)
    if not local_vars:
        return set()
    keys = set()
    if callable(getattr(opt, "get_slot_names", None)) and callable(getattr(opt, "get_slot", None)):
        for v in local_vars:
            for n in opt.get_slot_names():
                try:
                    keys |= variable_keys(opt.get_slot(v, n))
                except (KeyError, ValueError, AttributeError):
                    pass
        return keys
    trainable = getattr(opt, "_trainable_variables", None)
    if trainable is not None:  # Keras 3
        index = {k: i for i, w in enumerate(trainable) for k in variable_keys(w)}
        wanted = {index[k] for v in local_vars for k in variable_keys(v) if k in index}
        n = len(trainable)
    elif hasattr(opt, "_index_dict") and hasattr(opt, "_var_key"):  # tf-keras
        wanted = {opt._index_dict[opt._var_key(v)] for v in local_vars if opt._var_key(v) in opt._index_dict}
        n = len(opt._index_dict)
    else:
        return keys
    for name, value in vars(opt).items():
        if value is trainable or isinstance(value, (str, bytes)) or not isinstance(value, Sequence) \
                or len(value) != n or name.startswith("_self_") or name == "_variables":
            continue
        if not all(x is None or _is_variable(x) for x in value):
            continue
        for i in wanted:
            if value[i] is not None:
                keys |= variable_keys(value[i])
    return keys


def _model_built(model) -> bool:
    if not getattr(model, "built", False):
        return False
    try:
        return len(model.variables) > 0
    except ValueError:  # tf-keras: "Weights for model ... have not yet been created"
        return False


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank continue from root_rank's weights and optimizer state.

    A model whose weights exist when training starts (built with an Input, or restored) is
    broadcast then, so the first step already starts from root_rank's weights: the optimizer is
    built first if needed, so every rank broadcasts the same list (whether its optimizer was
    restored or fresh); if it cannot be built before the first step, its variables follow after
    that step. A model built lazily by its first batch (a Sequential without Input, Horovod's
    examples) is broadcast after the first batch, as Horovod does: every rank runs the first step
    from its own initial weights (with averaged gradients), and from the second step on the
    weights are root_rank's everywhere.

    ``local_variables`` (a variable or a list): left out of the broadcast, with their optimizer
    slots (momentum etc.), so they stay this rank's own. ``device`` is accepted and ignored.
    backward_passes_per_step's accumulators are never broadcast."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = int(root_rank)
        self.local_variables = _check_local_variables(local_variables)
        self._model_done = False
        self._optimizer_done = False

    def _variables(self, with_model: bool, with_optimizer: bool):
        local = set()
        for v in self.local_variables:
            local |= variable_keys(v)
        vs = [v for v in self.model.variables if not variable_keys(v) & local] if with_model else []
        opt = getattr(self.model, "optimizer", None)
        if with_optimizer and opt is not None:
            # backward_passes_per_step's accumulators hold this rank's own gradients: never broadcast
            skip = {id(v) for v in accumulators(opt)} | _local_slot_keys(opt, self.local_variables)
            vs += [v for v in _optimizer_variables(opt) if not variable_keys(v) & skip]
        return vs

    def _agree(self, flag: bool, what: str) -> bool:
        """True when every rank says True (an out-of-band min over ranks)."""
        if _fx.size() == 1:
            return flag
        return _fx.oob_allreduce(np.array([1.0 if flag else 0.0]), op="min",
                                 name=f"BroadcastGlobalVariables.{what}")[0] == 1.0

    def on_train_begin(self, logs=None):
        if not 0 <= self.root_rank < _fx.size():
            raise ValueError(f"root_rank {self.root_rank} is not a rank of this job (size {_fx.size()})")
        self._model_done = self._optimizer_done = False
        if not self._agree(_model_built(self.model), "model_built"):
            return  # built by the first batch: broadcast after it (on_train_batch_end)
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not _built(opt):
            # Build it now, so that every rank broadcasts the same variables whether or not its
            # optimizer was restored (load_model builds it; a fresh compile does not)
            try:
                opt.build(self.model.trainable_variables)
            except Exception:  # noqa: BLE001 - an optimizer that cannot be built early: after the first batch
                pass
        built = self._agree(opt is not None and _built(opt), "built")
        _ftf.broadcast_variables(self._variables(True, built), root_rank=self.root_rank)
        self._model_done, self._optimizer_done = True, built

    def on_train_batch_end(self, batch, logs=None):
        if self._optimizer_done:
            return
        _ftf.broadcast_variables(self._variables(not self._model_done, True), root_rank=self.root_rank)
        self._model_done = self._optimizer_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics in `logs` by their average over ranks, so that callbacks
    after it (early stopping, checkpointing, learning-rate schedules) see the same numbers
    everywhere. Put it before them in the callbacks list."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or _fx.size() == 1:
            return
        keys = sorted(k for k, v in logs.items()
                      if isinstance(v, (int, float, np.number)) or (hasattr(v, "numpy") and np.ndim(v) == 0))
        names = "\0".join(keys)
        # ranks must report the same metrics: compare a digest of the key list first
        digest = np.array([len(keys), zlib.crc32(names.encode())], np.float64)
        lo = _fx.oob_allreduce(digest, op="min", name="MetricAverageCallback.keys")
        hi = _fx.oob_allreduce(digest, op="max", name="MetricAverageCallback.keys")
        if not np.array_equal(lo, hi):
            raise _fx.MismatchError(f"MetricAverageCallback: ranks report different metrics (this rank: {keys})")
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], np.float64)
        avg = _fx.oob_allreduce(values, op="average", name="MetricAverageCallback.values")
        for k, v in zip(keys, avg):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's learning-rate schedule: between epochs ``start_epoch`` (inclusive) and
    ``end_epoch`` (exclusive; None: no end) the rate is ``initial_lr * multiplier(epoch)``.

    ``multiplier``: a function of the epoch, or a number m (then ``m ** epoch``: exponential
    decay). ``staircase=True``: set at the first batch of each epoch, with the integer epoch;
    ``False``: set before every batch, with the fractional epoch ``epoch + batch /
    steps_per_epoch`` (``steps_per_epoch`` is read from Keras when not given). Outside the range
    the rate is left as it is.

    ``momentum_correction`` (Goyal et al.): when the rate changes from lr_old to lr_new, the momentum
    buffers of SGD (and LARS, RMSpropToSGD), which carry the rate in Keras's update
    (v = m*v - lr*g), are multiplied by lr_new / lr_old. Horovod instead multiplies the momentum
    coefficient by that ratio for the one batch; both give the same update for plain momentum
    (not for Nesterov's). Optimizers without such buffers are not corrected. Logs the rate as
    ``lr`` at each epoch end. The optimizer's rate must be a number (a variable), not a schedule.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=multiplier: m ** epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None

    def lr_at(self, epoch: float) -> float:
        """The rate this callback sets at a (fractional) epoch inside its range."""
        return self.initial_lr * self.multiplier(epoch)

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}().")

    def on_train_begin(self, logs=None):
        _get_lr(self.model.optimizer)  # refuses schedules
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _adjust(self, epoch: float) -> None:
        old = _get_lr(self.model.optimizer)
        new = self.lr_at(epoch)
        if new == old:
            return
        if self.momentum_correction and old != 0:
            for m in _velocities(self.model.optimizer):
                m.assign(m * (new / old))
        _set_lr(self.model.optimizer, new)

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and
                                                     self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self.current_epoch)
        else:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warm-up, Horovod's: from about ``initial_lr / size`` to ``initial_lr``
    over ``warmup_epochs`` epochs, set before every batch::

        lr = initial_lr / size * ((epoch + 1/steps_per_epoch) * (size - 1) / warmup_epochs + 1)

    at the fractional epoch ``epoch + batch / steps_per_epoch`` (the ``1/steps_per_epoch`` shift,
    Horovod's, makes the last warm-up batch run at exactly ``initial_lr``); after the warm-up the
    rate is left alone. ``momentum_correction`` as LearningRateScheduleCallback. ``verbose``: rank
    0 prints when the warm-up ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        if initial_lr is not None and not initial_lr > 0:
            raise ValueError(f"initial_lr must be > 0, not {initial_lr!r}")
        if not warmup_epochs > 0:
            raise ValueError(f"warmup_epochs must be > 0, not {warmup_epochs!r}")
        self.warmup_epochs = warmup_epochs

        def multiplier(epoch):
            n = _fx.size()
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _fx.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_get_lr(self.model.optimizer):g}.")


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """keras.callbacks.ModelCheckpoint that writes on rank 0 only (same arguments). Put a
    MetricAverageCallback before it so that ``save_best_only`` decides on averaged metrics."""

    def _save_model(self, epoch, batch, logs):
        if _fx.rank() == 0:
            super()._save_model(epoch, batch, logs)


class BestModelCheckpoint(ModelCheckpoint):
    """Horovod's BestModelCheckpoint: a ModelCheckpoint with ``save_best_only=True`` that writes on
    rank 0 only (put a MetricAverageCallback before it, so the decision is on averaged metrics).

    As in Horovod, the path is not an argument of Horovod's signature: set ``.filepath`` before
    training (Horovod's Spark estimator does), or pass fastxfer's ``filepath=`` keyword."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        # Keras 3 checks the extension of the path when the callback is made: give it one that passes
        placeholder = filepath or ("best.weights.h5" if save_weights_only else "best.keras")
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint: set its .filepath (or pass filepath=) before training")
        super().on_train_begin(logs)


def rank0_only(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Returns `callback` on rank 0 and a callback that does nothing elsewhere (for loggers,
    TensorBoard and other side effects that one rank should own)."""
    return callback if _fx.rank() == 0 else keras.callbacks.Callback()


def average_variables(variables, name: str) -> None:
    """Replace each float variable by its average over ranks (one fused reduction)."""
    vs = [v for v in variables if np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)).kind == "f"]
    values = [np.ascontiguousarray(np.asarray(v.numpy() if hasattr(v, "numpy") else v)) for v in vs]
    handles = [_fx.allreduce_async(x, op="average", name=f"{name}.{i}") for i, x in enumerate(values)]
    for v, h in zip(vs, handles):
        v.assign(h.wait())


class ModelAveragingCallback(keras.callbacks.Callback):
    """Periodic model averaging (local SGD): workers train on their own data with a plain
    (not distributed) optimizer and average their weights every ``every_n_steps`` batches or
    every ``every_n_epochs`` epochs, and once more when training ends, so the final model is the
    same everywhere. Intel's recipe averaged every 5 epochs to cut communication.

    ``include_optimizer``: also average the optimizer's float state (momentum buffers).
    Non-float variables (counters) are left alone. Broadcast the initial weights first
    (BroadcastGlobalVariablesCallback) so that the workers start from the same point.
    """

    def __init__(self, every_n_steps: int | None = None, every_n_epochs: int | None = None,
                 include_optimizer: bool = False):
        super().__init__()
        if (every_n_steps is None) == (every_n_epochs is None):
            raise ValueError("give exactly one of every_n_steps and every_n_epochs")
        k = every_n_steps if every_n_steps is not None else every_n_epochs
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the averaging period must be an int >= 1, not {k!r}")
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs
        self.include_optimizer = include_optimizer
        self._steps = 0
        self._since = 0  # batches since the last average
        self.averages = 0  # how many times the weights were averaged

    def _average(self):
        vs = list(self.model.variables)
        if self.include_optimizer and getattr(self.model, "optimizer", None) is not None:
            vs += [v for v in self.model.optimizer.variables if v is not getattr(self.model.optimizer, "_iterations", None)]
        average_variables(vs, "ModelAveragingCallback")
        self.averages += 1
        self._since = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        self._since += 1
        if self.every_n_steps and self._steps % self.every_n_steps == 0:
            self._average()

    def on_epoch_end(self, epoch, logs=None):
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0 and self._since:
            self._average()

    def on_train_end(self, logs=None):
        if self._since:
            self._average()


class EarlyStopping(keras.callbacks.EarlyStopping):
    """keras.callbacks.EarlyStopping that stops every rank together: the monitored value is
    averaged over ranks before the decision, and the decision itself is agreed (any rank stopping
    stops all), so one rank can never stop alone and leave the others waiting in a collective.
    Same arguments as Keras's."""

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        if _fx.size() > 1:
            present = np.array([1.0 if self.monitor in logs else 0.0])
            if _fx.oob_allreduce(present, op="min", name="EarlyStopping.present")[0] == 1.0:
                v = np.array([float(logs[self.monitor])], np.float64)
                logs[self.monitor] = float(_fx.oob_allreduce(v, op="average", name="EarlyStopping.value")[0])
        super().on_epoch_end(epoch, logs)
        if _fx.size() > 1:
            stop = np.array([1.0 if self.model.stop_training else 0.0])
            if _fx.oob_allreduce(stop, op="max", name="EarlyStopping.stop")[0] == 1.0:
                self.model.stop_training = True
                if not self.stopped_epoch:
                    self.stopped_epoch = epoch
