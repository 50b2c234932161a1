"""Horovod's Keras callbacks for fastxfer: broadcast the initial state, average metrics, warm up
the learning rate, and checkpoint from rank 0 only.

They derive from Keras 3's callback classes, or from tf-keras's when ``TF_USE_LEGACY_KERAS=1`` is
set before the import (tf-keras models only call tf-keras callbacks)."""

from __future__ import annotations

import os
import zlib

import numpy as np

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":  # tf.keras is tf-keras: its models call its callbacks
    import tf_keras as keras
else:
    import keras

import fastxfer as _fx
import fastxfer.tensorflow as _ftf
from fastxfer.keras._distributed import accumulators


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def _built(optimizer) -> bool:
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def _velocities(optimizer) -> list:
    """Momentum buffers that carry the learning rate (v = m*v + lr*g): Keras's SGD (tf-keras's
    too) and fastxfer's LARS / RMSpropToSGD. Other optimizers' moments are not rescaled."""
    opt = _inner(optimizer)
    from fastxfer.keras.optimizers import LARS, RMSpropToSGD

    if isinstance(opt, (LARS, RMSpropToSGD)):
        return list(opt.velocities)
    if type(opt).__name__ == "SGD" or "SGD" in [c.__name__ for c in type(opt).__mro__]:
        return [m for m in (getattr(opt, "momentums", None) or []) if m is not None]
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


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from root_rank's weights and optimizer state.

    Broadcasts at the start of training, after building the optimizer if needed, so that every
    rank broadcasts the same list (whether its optimizer was restored or fresh); if an optimizer
    cannot be built before the first step, its variables are broadcast after that step."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = int(root_rank)
        self._optimizer_done = False

    def _variables(self, with_optimizer: bool):
        vs = list(self.model.variables)
        opt = getattr(self.model, "optimizer", None)
        if with_optimizer and opt is not None:
            # backward_passes_per_step's accumulators hold this rank's own gradients: never broadcast
            local = {id(v) for v in accumulators(opt)}
            ovs = list(opt.variables) if not callable(opt.variables) else list(opt.variables())
            vs += [v for v in ovs if id(v) not in local]
        return vs

    def on_train_begin(self, logs=None):
        if not 0 <= self.root_rank < _fx.size():
            raise ValueError(f"root_rank {self.root_rank} is not a rank of this job (size {_fx.size()})")
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not _built(opt):
            # Build it now, so that every rank broadcasts the same variables whether or not its
            # optimizer was restored (load_model builds it; a fresh compile does not)
            try:
                opt.build(self.model.trainable_variables)
            except Exception:  # noqa: BLE001 - an optimizer that cannot be built early: after the first batch
                pass
        built = np.array([1.0 if opt is not None and _built(opt) else 0.0])
        built = _fx.size() == 1 or _fx.oob_allreduce(built, op="min", name="BroadcastGlobalVariables.built")[0] == 1.0
        _ftf.broadcast_variables(self._variables(built), root_rank=self.root_rank)
        self._optimizer_done = built

    def on_train_batch_end(self, batch, logs=None):
        if not self._optimizer_done:
            _ftf.broadcast_variables(self._variables(True), root_rank=self.root_rank)
            self._optimizer_done = True


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


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Goyal et al.'s gradual warm-up: the learning rate grows linearly, batch by batch, from
    ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` epochs (Horovod's formula).

    ``momentum_correction``: when the rate changes from lr_old to lr_new, SGD's velocity (which
    includes the rate in Keras's update) is multiplied by lr_new / lr_old, as in Goyal et al.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        super().__init__()
        if not initial_lr > 0:
            raise ValueError(f"initial_lr must be > 0, not {initial_lr!r}")
        if not warmup_epochs > 0:
            raise ValueError(f"warmup_epochs must be > 0, not {warmup_epochs!r}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = float(warmup_epochs)
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._current = None

    def lr_at(self, epoch: float) -> float:
        """The warm-up rate at a fractional epoch."""
        n = _fx.size()
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        return self.initial_lr / n * (epoch * (n - 1) / self.warmup_epochs + 1)

    def on_train_begin(self, logs=None):
        _get_lr(self.model.optimizer)  # refuses schedules
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (Keras did not report it)")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        e = self._epoch + batch / self.steps_per_epoch
        if e > self.warmup_epochs and self._current == self.initial_lr:
            return
        new = self.lr_at(e)
        old = _get_lr(self.model.optimizer)
        if new == old:
            return
        if self.momentum_correction and old > 0:
            for m in _velocities(self.model.optimizer):
                m.assign(m * (new / old))
        _set_lr(self.model.optimizer, new)
        self._current = new
        if self.verbose and _fx.rank() == 0 and batch == 0:
            print(f"\nEpoch {self._epoch + 1}: LearningRateWarmupCallback sets the learning rate to {new:.6g}")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """keras.callbacks.ModelCheckpoint that writes on rank 0 only (same arguments). Put a
    MetricAverageCallback before it so that ``save_best_only`` decides on averaged metrics."""

    def _save_model(self, epoch, batch, logs):
        if _fx.rank() == 0:
            super()._save_model(epoch, batch, logs)


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
