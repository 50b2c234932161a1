"""fastxfer.keras in one process, without the launcher: argument errors, wrapping in place, the
XLA refusal, and the FASTXFER_TF_PIN setting."""

import importlib.util
import os
import sys

import pytest

from _launch import run_command

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def test_errors_without_launcher():
    code = """
import keras, fastxfer.keras as hvd
try:
    hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
except hvd.FastxferError as e:
    assert "init()" in str(e); print("OK before init")
hvd.init()
for bad, kw in [("compression", dict(compression="int8")), ("backward_passes_per_step", dict(backward_passes_per_step=0)),
                ("bucket_cap_mb", dict(bucket_cap_mb=-1)), ("op", dict(op="max"))]:
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw)
    except ValueError as e:
        assert bad in str(e), str(e); print("OK", bad)
try:
    hvd.DistributedOptimizer(object())
except TypeError as e:
    print("OK type")
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3))
assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
adamw = keras.optimizers.AdamW(1e-3)
adamw.exclude_from_weight_decay(var_names=["bias"])
class Sched(keras.optimizers.schedules.LearningRateSchedule):  # unregistered: no config round trip
    def __call__(self, step):
        return 0.1
sgd = keras.optimizers.SGD(Sched())
assert hvd.DistributedOptimizer(adamw) is adamw and hvd.DistributedOptimizer(sgd) is sgd  # wrapped in place
assert adamw._exclude_from_weight_decay_pattern.pattern == "bias"
try:
    hvd.DistributedOptimizer(opt)
except ValueError as e:
    print("OK twice")
import tensorflow as tf
@tf.function(jit_compile=True)
def f(x):
    return hvd.allreduce(x)
try:
    f(tf.constant([1.0]))
except hvd.FastxferError as e:
    assert "jit_compile" in str(e); print("OK xla")
hvd.shutdown()
"""
    r = run_command([sys.executable, "-c", code], timeout=300, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    for tag in ["before init", "compression", "backward_passes_per_step", "bucket_cap_mb", "op", "type", "twice", "xla"]:
        assert f"OK {tag}" in r.stdout, (tag, r.stdout, r.stderr[-2000:])


def test_pin_modes(monkeypatch):
    from fastxfer.tensorflow import overlap

    for value, want in [("1", True), ("on", True), ("0", False), ("off", False)]:
        monkeypatch.setenv("FASTXFER_TF_PIN", value)
        assert overlap.pin_enabled() is want
    monkeypatch.setenv("FASTXFER_TF_PIN", "sometimes")
    with pytest.raises(ValueError, match="FASTXFER_TF_PIN"):
        overlap.pin_enabled()
    monkeypatch.setenv("FASTXFER_TF_PIN", "auto")
    monkeypatch.setenv("FASTXFER_ENGINE_CPUS", "1")
    assert overlap.pin_enabled() is True  # the engine has a core of its own
