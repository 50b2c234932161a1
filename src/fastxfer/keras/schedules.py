"""Learning-rate scaling and schedules for large batches (Goyal et al. 2017): linear or
square-root scaling with the global batch, gradual warm-up, polynomial decay, multistep.

All schedules are ``keras.optimizers.schedules.LearningRateSchedule``s (serializable), called
with the optimizer's step counter, so they behave the same on every rank.
"""

from __future__ import annotations

import math

import keras
from keras import ops


def scale_lr(base_lr: float, global_batch: int, base_batch: int = 256, rule: str = "linear") -> float:
    """The learning rate for ``global_batch`` given one tuned for ``base_batch``:
    ``linear``: base_lr * global/base (Goyal et al.); ``sqrt``: base_lr * sqrt(global/base)
    (Krizhevsky; Hoffer et al.)."""
    if base_lr <= 0 or global_batch <= 0 or base_batch <= 0:
        raise ValueError("base_lr, global_batch and base_batch must be > 0")
    k = global_batch / base_batch
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    raise ValueError(f"rule must be 'linear' or 'sqrt', not {rule!r}")


def _value(schedule, step):
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return schedule(step)
    return ops.cast(schedule, "float32")


@keras.saving.register_keras_serializable(package="fastxfer")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Gradual warm-up: from ``initial_lr`` (default target/100: a slow start) to the wrapped
    schedule's value, linearly over ``warmup_steps``; after that, ``after`` unchanged.

    ``after``: a float (constant rate) or any LearningRateSchedule, called with the step counted
    from the end of warm-up when ``offset=True`` (default) or from 0 otherwise.
    """

    def __init__(self, after, warmup_steps: int, initial_lr: float | None = None, offset: bool = True):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, not {warmup_steps}")
        self.after = after
        self.warmup_steps = int(warmup_steps)
        self.initial_lr = initial_lr
        self.offset = offset

    def __call__(self, step):
        step = ops.cast(step, "float32")
        w = float(self.warmup_steps)
        later = _value(self.after, ops.maximum(step - w, 0.0) if self.offset else step)
        if self.warmup_steps == 0:
            return later
        target = _value(self.after, 0.0 if self.offset else w)
        start = target / 100.0 if self.initial_lr is None else ops.cast(self.initial_lr, "float32")
        warm = start + (target - start) * (step / w)
        return ops.where(step < w, warm, later)

    def get_config(self):
        after = self.after
        if isinstance(after, keras.optimizers.schedules.LearningRateSchedule):
            after = keras.saving.serialize_keras_object(after)
        return {"after": after, "warmup_steps": self.warmup_steps, "initial_lr": self.initial_lr,
                "offset": self.offset}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config["after"], dict):
            config["after"] = keras.saving.deserialize_keras_object(config["after"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="fastxfer")
class MultiStep(keras.optimizers.schedules.LearningRateSchedule):
    """``initial_lr`` multiplied by ``gamma`` at each step in ``milestones`` (the ImageNet recipe:
    x0.1 at epochs 30, 60, 80 -- give the milestones in optimizer steps)."""

    def __init__(self, initial_lr: float, milestones, gamma: float = 0.1):
        ms = [int(m) for m in milestones]
        if ms != sorted(ms) or any(m < 0 for m in ms):
            raise ValueError(f"milestones must be increasing non-negative steps, not {milestones!r}")
        self.initial_lr = float(initial_lr)
        self.milestones = ms
        self.gamma = float(gamma)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        passed = sum(ops.cast(step >= float(m), "float32") for m in self.milestones) if self.milestones else 0.0
        return self.initial_lr * ops.power(self.gamma, passed)

    def get_config(self):
        return {"initial_lr": self.initial_lr, "milestones": self.milestones, "gamma": self.gamma}


@keras.saving.register_keras_serializable(package="fastxfer")
class PolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """``(initial_lr - end_lr) * (1 - step/decay_steps)^power + end_lr``, then ``end_lr``
    (power 2 is the LARS paper's ImageNet schedule)."""

    def __init__(self, initial_lr: float, decay_steps: int, end_lr: float = 0.0, power: float = 2.0):
        if decay_steps <= 0:
            raise ValueError(f"decay_steps must be > 0, not {decay_steps}")
        self.initial_lr, self.decay_steps, self.end_lr, self.power = float(initial_lr), int(decay_steps), \
            float(end_lr), float(power)

    def __call__(self, step):
        frac = ops.minimum(ops.cast(step, "float32"), float(self.decay_steps)) / float(self.decay_steps)
        return (self.initial_lr - self.end_lr) * ops.power(1.0 - frac, self.power) + self.end_lr

    def get_config(self):
        return {"initial_lr": self.initial_lr, "decay_steps": self.decay_steps, "end_lr": self.end_lr,
                "power": self.power}
