"""DistributedOptimizer for Keras 3 optimizers (and tf-keras 2.x ones, see _legacy.py).

The wrapper is a subclass of the wrapped optimizer's own class, made at run time, so
``isinstance(opt, keras.optimizers.SGD)`` still holds and checkpoints keep their layout;
``get_config`` is the wrapped class's, so a saved model reloads with the plain optimizer
(``fastxfer.keras.load_model`` wraps it again, as Horovod's does). Its ``apply`` reduces the
gradients across ranks first and then runs the wrapped class's ``apply`` unchanged, so clipping,
weight decay, EMA and schedules all act on the averaged gradient, identically on every rank.
``DistributedOptimizer`` (tf-keras optimizers go to tf_keras_optimizer.py) and ``load_model`` live here too;
what the two kinds of wrapper share is in distributed_optimizer.py. fastxfer.keras and
fastxfer.tensorflow.DistributedOptimizer both come here: the Keras package builds on this one.

Inside ``model.fit`` the reduction is traced into the training function: each gradient is handed
to fastxfer's engine by its own op as soon as TensorFlow has computed it (see
fastxfer.tensorflow), so the engine reduces the last layers' gradients while the backward pass is
still working on the first ones.
"""

from __future__ import annotations

import functools
import sys
import warnings

import keras
import tensorflow as tf

import fastxfer as fx
from fastxfer.comm import group
from fastxfer.tensorflow.distributed_optimizer import (ACCUMULATORS, PASSES, Settings, accumulate_and_apply, distributed_class,
                                         is_distributed, new_settings, reduce_gradients)
from fastxfer.tensorflow.sync_batch_norm import SyncBatchNormalization
from fastxfer.tensorflow.basics import global_process_set
from fastxfer.tensorflow.compression import Compression
from fastxfer.tensorflow.ops import Average
from fastxfer.tensorflow.tape import GradientReduction, check_local_layers, gradient_options


def _dtype(v):
    d = getattr(v, "dtype", "float32")
    return tf.as_dtype(d if not hasattr(d, "as_numpy_dtype") else d.name)


def _called_from_foreign_loss_scaler(opt) -> bool:
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, keras.optimizers.LossScaleOptimizer) and not is_distributed(obj) \
                and getattr(obj, "inner_optimizer", None) is opt:
            return True
        f = f.f_back
    return False


_xla_warned = False


def _uses_fastxfer(model) -> bool:
    opt = getattr(model, "optimizer", None)
    return is_distributed(opt) or is_distributed(getattr(opt, "inner_optimizer", None))


def _no_xla_for(model) -> None:
    """The reduction runs on the host, outside XLA: build the model's training step without XLA
    (Keras turns jit_compile on by itself on GPU machines: jit_compile="auto")."""
    global _xla_warned
    if not (_uses_fastxfer(model) and getattr(model, "jit_compile", False)):
        return
    model.jit_compile = False
    if not _xla_warned and fx.is_initialized() and fx.rank() == 0:
        warnings.warn("fastxfer: this model's training step runs without XLA (jit_compile=False): fastxfer's "
                      "gradient reduction runs on the host and cannot be compiled by XLA.", stacklevel=3)
    _xla_warned = True


def _marked_steps(step):
    """The training step, with a mark on the timeline where each call starts and ends."""
    count = [0]

    def train_function(*args, **kwargs):
        n = count[0]
        count[0] += 1
        group.mark(f"step {n} begins")
        try:
            return step(*args, **kwargs)
        finally:
            group.mark(f"step {n} ends")

    train_function._fastxfer_marked = True
    return train_function


def install_trainer_hook() -> None:
    """Wrap Keras's TensorFlowTrainer.make_train_function once: for models whose optimizer is a
    fastxfer DistributedOptimizer, turn jit_compile off before the training step is traced, and,
    when a timeline is being written (FASTXFER_TIMELINE), mark each step on it. Other models are
    untouched."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original = TensorFlowTrainer.make_train_function
    if getattr(original, "_fastxfer_hook", False):
        return

    def make_train_function(self, force=False):
        _no_xla_for(self)
        ret = original(self, force=force)
        fn = self.train_function  # Keras sets it (and may return nothing)
        if fn is not None and _uses_fastxfer(self) and fx.is_initialized() and group.engine().timeline_enabled \
                and not getattr(fn, "_fastxfer_marked", False):
            self.train_function = _marked_steps(fn)
            return self.train_function if ret is not None else ret
        return ret

    make_train_function._fastxfer_hook = True
    make_train_function.__doc__ = original.__doc__
    TensorFlowTrainer.make_train_function = make_train_function


_LEGACY_COMPILE_KEYWORDS = ("experimental_run_tf_function",)
_compile_warned = False


def install_compile_shim() -> None:
    """Let Keras 3's Model.compile accept (and ignore) ``experimental_run_tf_function``, which every
    Horovod Keras script of the TensorFlow 2.0-2.3 era passes (False: "use hvd.DistributedOptimizer
    to compute gradients"). Keras 3 has no such argument -- its training step always calls the
    optimizer's apply, which is where fastxfer reduces -- so the keyword is dropped, with a warning
    on rank 0, and no other keyword is touched. tf-keras accepts the keyword itself. Installed
    once, for every model, when fastxfer.keras is imported (docs/keras.md, "Old Horovod scripts")."""
    from keras.src.trainers.trainer import Trainer

    original = Trainer.compile
    if getattr(original, "_fastxfer_hook", False):
        return

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        global _compile_warned
        dropped = [k for k in _LEGACY_COMPILE_KEYWORDS if k in kwargs]
        for k in dropped:
            kwargs.pop(k)
        if dropped and not _compile_warned:
            _compile_warned = True
            if not fx.is_initialized() or fx.rank() == 0:
                warnings.warn(f"fastxfer.keras: Keras 3's Model.compile has no {', '.join(dropped)} argument; it is "
                              "ignored (Keras 3 always applies gradients through the optimizer, where fastxfer's "
                              "DistributedOptimizer reduces them)", stacklevel=2)
        return original(self, *args, **kwargs)

    compile._fastxfer_hook = True
    Trainer.compile = compile


class _DistributedMixin:
    """Methods that the run-time subclass puts in front of the wrapped optimizer's class."""

    def build(self, variables):
        super().build(variables)
        s = self._fastxfer
        if s.k > 1:
            # Local accumulators for backward_passes_per_step. Kept out of the optimizer's tracked
            # variables (set through __dict__): a saved model reloads with the plain optimizer,
            # whose variable list must match; a partial accumulation is transient anyway.
            with tf.init_scope():
                self.__dict__[ACCUMULATORS] = [
                    tf.Variable(tf.zeros(v.shape, _dtype(v)), trainable=False, name="fastxfer_accumulator")
                    for v in variables]
                self.__dict__[PASSES] = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                                    name="fastxfer_passes")

    def apply(self, grads, trainable_variables=None):
        if _called_from_foreign_loss_scaler(self):
            raise fx.FastxferError(
                "Keras wrapped fastxfer's DistributedOptimizer in its own LossScaleOptimizer (mixed_float16), which "
                "would decide to skip a step on each rank separately, before the gradients are reduced. Create the "
                "DistributedOptimizer after keras.mixed_precision.set_global_policy('mixed_float16') (it then scales "
                "the loss itself), or pass it a keras.optimizers.LossScaleOptimizer.")
        if trainable_variables is None:
            if not self.built:
                raise ValueError("apply() without variables needs a built optimizer: call build(variables) first")
            trainable_variables = self._trainable_variables
        variables = list(trainable_variables)
        grads = list(grads)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        s = self._fastxfer
        if s.k == 1:
            return super().apply(reduce_gradients(s, grads, variables), variables)
        return self._fastxfer_apply_accumulated(grads, variables)

    def _fastxfer_apply_accumulated(self, grads, variables):
        accs = [self.__dict__[ACCUMULATORS][self._get_variable_index(v)] for v in variables]
        accumulate_and_apply(self._fastxfer, self.__dict__[PASSES], accs, grads, variables,
                             lambda reduced: super(_DistributedMixin, self).apply(reduced, variables))

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # a copy built from a config is distributed too (with the default settings: the config
        # is the wrapped class's and holds none of fastxfer's)
        config = dict(config)  # from_config may deserialize entries in place: not in the caller's dict
        base = cls._fastxfer_base  # the wrapped class
        inner = base.from_config(config, custom_objects=custom_objects) if custom_objects else base.from_config(config)
        return DistributedOptimizer(inner)


class _DistributedLossScaleMixin:
    """For keras.optimizers.LossScaleOptimizer: reduce the (scaled) gradients before the finite
    check, so every rank sees the same sum and skips or applies the step together."""

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self.inner_optimizer._trainable_variables
        variables = list(trainable_variables)
        return super().apply(reduce_gradients(self._fastxfer, list(grads), variables), variables)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        inner = keras.optimizers.LossScaleOptimizer.from_config(dict(config), custom_objects=custom_objects)
        return DistributedOptimizer(inner)


def distributed_keras3(optimizer, settings: Settings):
    if is_distributed(optimizer):
        raise ValueError("this optimizer is already a fastxfer DistributedOptimizer")
    if getattr(optimizer, "built", False):
        raise ValueError("wrap the optimizer before it is built (before model.fit or apply_gradients ran with it)")
    lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if not lso and keras.config.dtype_policy().name == "mixed_float16":
        # Keras would wrap us in its LossScaleOptimizer at compile(); wrap first, distributed
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        lso = True
    if lso:
        if settings.k != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported with loss scaling (mixed_float16): "
                             "use mixed_bfloat16, which needs no loss scaling, or backward_passes_per_step=1")
        if is_distributed(optimizer.inner_optimizer):
            raise ValueError("pass the plain optimizer inside the LossScaleOptimizer, not a DistributedOptimizer")
        cls = distributed_class(type(optimizer), _DistributedLossScaleMixin)
    else:
        cls = distributed_class(type(optimizer), _DistributedMixin)
    # The optimizer object itself becomes distributed (its class is swapped): rebuilding it from
    # its config would lose what the config does not hold (exclude_from_weight_decay, callables,
    # unregistered schedules) and fail for custom classes.
    optimizer.__class__ = cls
    optimizer._fastxfer = settings
    return optimizer


def _wrap_in_place(optimizer, settings: Settings):
    """Make an existing (possibly built, e.g. restored) Keras 3 optimizer distributed, keeping its
    state: its class becomes the distributed subclass."""
    lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if settings.k != 1:
        raise ValueError("wrap_in_place supports backward_passes_per_step=1 only")
    optimizer.__class__ = distributed_class(type(optimizer), _DistributedLossScaleMixin if lso else _DistributedMixin)
    optimizer._fastxfer = settings
    return optimizer


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True, bucket_cap_mb=None):
    """Wrap a Keras optimizer so that it averages gradients across ranks before applying them.

    Returns ``optimizer`` itself, its class swapped for a run-time subclass of its class
    (``isinstance`` holds, the state the config does not hold is kept), so wrap it before it is
    used. Arguments as Horovod's:

    - ``compression``: Compression.none / .bf16 / .fp16: how float32 gradients travel (reduced in
      float32 either way); or a user compressor (an object or class with Horovod's
      ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``), run in TensorFlow
      around an uncompressed reduction.
    - ``sparse_as_dense``: make sparse gradients (tf.IndexedSlices, from embedding lookups) dense
      and reduce them; by default they are allgathered (values and indices), as Horovod does.
    - ``backward_passes_per_step=k``: accumulate k local gradients, reduce and apply on the k-th
      (k-times fewer reductions); ``average_aggregated_gradients`` divides the sum by k, which
      makes k passes of batch B equal one pass of batch k*B.
    - ``gradient_predivide_factor=f``: divide by f before the sum and by size/f after it.
    - ``op``: Average (default) or Sum.
    - ``scale_local_gradients``: gradients of variables registered with ``register_local_var``
      (or PartialDistributedOptimizer's local layers) are not reduced; with True (Horovod's
      default) they are divided by the number of ranks.
    - ``bucket_cap_mb`` (fastxfer's): fusion bucket size for these gradients (default: ``init``'s, 25 MiB).
    - ``groups``: Horovod's explicit fusion groups: an int n cuts the gradients (in variable order)
      into n consecutive groups; a list of lists of variables makes each list a group and every
      other variable a group of its own. Each group is reduced as one unit: held until its last
      gradient, never sharing a bucket with another group. ``num_groups=n`` is the deprecated
      spelling of ``groups=n`` (not both). Without them the engine fuses by itself.
    - ``device_dense``, ``device_sparse`` are accepted for Horovod compatibility and have no
      effect: the engine runs on the host.
    - ``process_set``: reduce among that registered set's ranks only (an average divides by its
      size); every rank of the set must wrap its optimizer with the same set. A rank outside the
      set applies its own gradients, unreduced (Horovod's rule).
    - ``name``: unused (Keras 3 optimizers keep their own name).

    The result has ``register_local_var(var)``. Under ``mixed_float16`` (set before this call) or
    given a LossScaleOptimizer, the result is a LossScaleOptimizer that reduces the scaled
    gradients before its finite check, so every rank skips or applies a step together. Keras's XLA
    (``jit_compile``) is turned off for the training step, because the reduction runs on the host.
    """
    settings = new_settings(compression, backward_passes_per_step, average_aggregated_gradients,
                            gradient_predivide_factor, bucket_cap_mb, op, sparse_as_dense, scale_local_gradients,
                            process_set, num_groups, groups)
    if isinstance(optimizer, (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer)):
        return distributed_keras3(optimizer, settings)
    try:
        from fastxfer.tensorflow import tf_keras_optimizer  # needs tf-keras, an optional dependency
    except ImportError:
        tf_keras_optimizer = None
    if tf_keras_optimizer is not None and tf_keras_optimizer.is_legacy_optimizer(optimizer):
        return tf_keras_optimizer.distributed_legacy(optimizer, settings)
    raise TypeError(f"DistributedOptimizer wraps a Keras optimizer (keras.optimizers.* or tf_keras.optimizers.*), "
                    f"not {type(optimizer).__name__}")


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                                sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False, groups=None,
                                process_set=global_process_set, local_layers=None, scale_local_gradients=True,
                                bucket_cap_mb=None):
    """A DistributedOptimizer whose ``local_layers`` (a layer or a list of layers) keep their
    gradients on their rank (their weights may differ between ranks); the other gradients are
    averaged. The layers' weights are looked up when gradients are applied, so layers built
    lazily (on the first batch) work too. Other arguments as DistributedOptimizer."""
    layers = check_local_layers(local_layers)
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                               compression=compression, sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               backward_passes_per_step=backward_passes_per_step,
                               average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                               process_set=process_set, scale_local_gradients=scale_local_gradients,
                               bucket_cap_mb=bucket_cap_mb)
    for layer in layers:
        opt._fastxfer.local.add_layer(layer)
    return opt


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, **kwargs):
    """keras.models.load_model, with the loaded optimizer wrapped in a DistributedOptimizer (the
    saved file holds the plain optimizer)."""
    objects = dict(custom_objects or {})
    objects.setdefault("SyncBatchNormalization", SyncBatchNormalization)
    for o in custom_optimizers or []:
        objects[o.__name__] = o
    model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not is_distributed(opt):
        _wrap_in_place(opt, Settings(GradientReduction(gradient_options(compression=compression),
                                                       prefix="DistributedOptimizer")))  # keeps its state
    return model


# model.fit of a model with a DistributedOptimizer must trace its training step without XLA, and
# Horovod scripts pass model.compile(..., experimental_run_tf_function=False), which Keras 3 lacks:
# both hooks are installed when this module is first imported (by fastxfer.keras, or by the first
# fastxfer.tensorflow.DistributedOptimizer of a Keras optimizer)
install_trainer_hook()
install_compile_shim()
