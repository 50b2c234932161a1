"""Large-batch optimizers for Keras 3: LARS and the RMSprop-to-SGD warm-up transition.

Both are ordinary Keras optimizers (serializable, usable with any Keras 3 model) and can be
wrapped in ``fastxfer.keras.DistributedOptimizer`` like any other. Formulas: docs/large_batch.md.
"""

from __future__ import annotations

import keras
from keras import ops


def _is_excluded_default(variable) -> bool:
    # You et al. exclude biases and batch-norm parameters: the 0-D/1-D variables
    return len(variable.shape) <= 1


@keras.saving.register_keras_serializable(package="fastxfer")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You, Gitman, Ginsburg 2017), SGD with momentum.

    For each adapted variable w with gradient g (per step, global learning rate lr)::

        trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)   (1 if ||w|| or ||g|| is 0)
        v     = momentum * v + lr * trust * (g + weight_decay * w)
        w     = w - v

    Excluded variables (by default every variable with at most one dimension: biases and
    batch-norm scales and offsets, as in the paper) take the plain momentum step
    ``v = momentum * v + lr * g`` with neither adaptation nor weight decay. ``exclude`` names
    variables to exclude as well (substrings of ``variable.path``).
    """

    def __init__(self, learning_rate=0.1, momentum=0.9, weight_decay=1e-4, eta=0.001, epsilon=1e-9,
                 exclude=None, name="lars", **kwargs):
        kwargs.pop("weight_decay", None)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), not {momentum!r}")
        if weight_decay < 0 or eta <= 0 or epsilon < 0:
            raise ValueError("weight_decay and epsilon must be >= 0 and eta > 0")
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.exclude = list(exclude or [])

    def _excluded(self, variable) -> bool:
        path = getattr(variable, "path", variable.name)
        return _is_excluded_default(variable) or any(s in path for s in self.exclude)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.velocities = self.add_optimizer_variables(var_list, "velocity")
        self._lars_excluded = [self._excluded(v) for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        i = self._get_variable_index(variable)
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        v = self.velocities[i]
        if self._lars_excluded[i]:
            step = lr * g
        else:
            wd = ops.cast(self.lars_weight_decay, variable.dtype)
            w_norm = ops.sqrt(ops.sum(ops.square(variable)))
            g_norm = ops.sqrt(ops.sum(ops.square(g)))
            trust = ops.where(ops.logical_and(w_norm > 0, g_norm > 0),
                              self.eta * w_norm / (g_norm + wd * w_norm + self.epsilon), ops.ones_like(w_norm))
            step = lr * trust * (g + wd * variable)
        self.assign(v, self.momentum * v + step)
        self.assign_sub(variable, v)

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, weight_decay=self.lars_weight_decay, eta=self.eta,
                      epsilon=self.epsilon, exclude=self.exclude)
        return config


@keras.saving.register_keras_serializable(package="fastxfer")
class RMSpropToSGD(keras.optimizers.Optimizer):
    """The RMSprop warm-up of Akiba, Suzuki, Fukuda (2017, ResNet-50 on ImageNet in 15 minutes):
    training starts as RMSprop and turns gradually into momentum SGD.

    With alpha the RMSprop weight at step t (1 until ``transition_begin``, falling linearly to 0
    at ``transition_end``, in optimizer steps)::

        m = rho * m + (1 - rho) * g^2
        v = momentum * v + lr * ((1 - alpha) + alpha / (sqrt(m) + epsilon)) * g
        w = w - v

    Pair it with a slow-start learning rate (``schedules.WarmupSchedule``), as the paper does.
    """

    def __init__(self, learning_rate=0.1, momentum=0.9, rho=0.99, epsilon=1e-7, transition_begin=0,
                 transition_end=1000, name="rmsprop_to_sgd", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if not 0 <= transition_begin <= transition_end:
            raise ValueError("need 0 <= transition_begin <= transition_end")
        self.momentum = float(momentum)
        self.rho = float(rho)
        self.epsilon = float(epsilon)
        self.transition_begin = int(transition_begin)
        self.transition_end = int(transition_end)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.velocities = self.add_optimizer_variables(var_list, "velocity")
        self.mean_squares = self.add_optimizer_variables(var_list, "mean_square")

    def rmsprop_weight(self, step):
        """alpha at an optimizer step (a tensor or a number)."""
        b, e = self.transition_begin, self.transition_end
        step = ops.cast(step, "float32")
        if e == b:
            return ops.where(step < b, 1.0, 0.0)
        return ops.clip(1.0 - (step - b) / float(e - b), 0.0, 1.0)

    def update_step(self, gradient, variable, learning_rate):
        i = self._get_variable_index(variable)
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        alpha = ops.cast(self.rmsprop_weight(self.iterations), variable.dtype)
        m, v = self.mean_squares[i], self.velocities[i]
        self.assign(m, self.rho * m + (1 - self.rho) * ops.square(g))
        scale = (1 - alpha) + alpha / (ops.sqrt(m) + self.epsilon)
        self.assign(v, self.momentum * v + lr * scale * g)
        self.assign_sub(variable, v)

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, rho=self.rho, epsilon=self.epsilon,
                      transition_begin=self.transition_begin, transition_end=self.transition_end)
        return config
