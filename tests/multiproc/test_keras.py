"""fastxfer.keras through the launcher: model.fit with DistributedOptimizer in every execution mode
matches one process training on the concatenated batch and leaves bit-identical weights on every
rank; SyncBatchNormalization matches BatchNormalization on the whole batch; the callbacks; errors;
tf-keras; a Horovod-style example that differs only in its import."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from _launch import launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "keras_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ok(r, pattern, count=2):
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert len(re.findall(pattern, r.stdout)) == count, r.stdout[-4000:]


@pytest.mark.parametrize("modes", ["graph,eager,jit,accum", "bf16comm,mixed_bfloat16,mixed_float16"])
def test_fit_matches_one_process_on_the_whole_batch(modes):
    r = launch(2, W, "fit", modes, env=ENV, timeout=900)
    for m in modes.split(","):
        _ok(r, rf"OK fit {m} rank \d")


def test_fit_three_workers():
    r = launch(3, W, "fit", "graph", env=ENV, timeout=900)
    _ok(r, r"OK fit graph rank \d", 3)


def test_none_gradients_skipped_everywhere_or_mismatch():
    r = launch(2, W, "nonegrads", env=ENV, timeout=900)
    _ok(r, r"OK nonegrads rank \d")


@pytest.mark.parametrize("inter_op", ["1", "2"])
def test_gradients_are_submitted_during_the_backward_pass(inter_op):
    r = launch(2, W, "overlap", env={**ENV, "TF_NUM_INTEROP_THREADS": inter_op, "FASTXFER_TF_PIN": "1"}, timeout=600)
    _ok(r, r"OK overlap rank \d")


def test_sync_batch_normalization_matches_whole_batch():
    r = launch(2, W, "syncbn", env=ENV, timeout=900)
    _ok(r, r"OK syncbn rank \d")


def test_callbacks(tmp_path):
    r = launch(2, W, "callbacks", str(tmp_path), env=ENV, timeout=900)
    _ok(r, r"OK callbacks rank \d")
    import keras

    model = keras.models.load_model(tmp_path / "model.keras")  # rank 0's checkpoint loads
    assert model.count_params() > 0


def test_models_that_differ_raise_mismatch_on_every_rank():
    r = launch(2, W, "mismatch", env=ENV, timeout=900)
    _ok(r, r"OK mismatch rank \d: MismatchError.*'DistributedOptimizer\.\d+\.bias'")


def test_bucket_cap_per_request():
    r = launch(2, W, "bucketcap", env=ENV, timeout=600)
    _ok(r, r"OK bucketcap rank \d")


def test_bench_train_smoke(tmp_path):
    out = tmp_path / "train.json"
    r = subprocess.run([sys.executable, "-m", "fastxfer.cli", "bench", "train", "--steps", "2", "--warmup", "1",
                        "--no-peers", "--model", "MobileNetV3Small", "--json", str(out)], capture_output=True,
                       text=True, timeout=900, cwd="/", env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    res = json.loads(out.read_text())
    names = [x["name"] for x in res["results"]]
    assert names[0] == "alone (1 worker)" and "fastxfer bf16" in names and "no-comm (2 independent workers)" in names
    for x in res["results"]:
        assert x["ms_per_step"] > 0 and abs(x["efficiency"] - res["results"][0]["ms_per_step"] / x["ms_per_step"]) < 1e-9
    assert "scaling efficiency" in r.stdout and "| fastxfer bf16 | 2 |" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed")
def test_tf_keras_legacy():
    r = launch(2, W, "fit", "graph,eager,bf16comm,accum,mixed_float16", env={**ENV, "TF_USE_LEGACY_KERAS": "1"},
               timeout=900)
    for m in ["graph", "eager", "bf16comm", "accum", "mixed_float16"]:
        _ok(r, rf"OK fit {m} rank \d")


def test_horovod_style_example_runs_unchanged_but_the_import(tmp_path):
    example = os.path.join(ROOT, "examples", "keras_horovod_style.py")
    with open(example) as f:
        src = f.read()
    # the example is a Horovod script: apart from its docstring, only the import line names fastxfer
    import ast

    doc = ast.get_docstring(ast.parse(src), clean=False)
    code = src.replace(doc, "")
    assert [ln for ln in code.splitlines() if "fastxfer" in ln] == ["import fastxfer.keras as hvd"]
    r = subprocess.run([sys.executable, "-m", "fastxfer.cli", "run", "-np", "2", "--", sys.executable, example,
                        "--epochs", "2", "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=900, cwd="/", env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"final accuracy ([\d.]+)", r.stdout)]
    assert len(acc) == 1 and acc[0] > 0.8, r.stdout[-3000:]  # printed by rank 0 only
    assert os.listdir(tmp_path) == ["checkpoint.keras"]


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
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
                       env={**os.environ, **ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    for tag in ["before init", "compression", "backward_passes_per_step", "bucket_cap_mb", "op", "type", "twice", "xla"]:
        assert f"OK {tag}" in r.stdout, (tag, r.stdout, r.stderr[-2000:])


def test_pin_modes(monkeypatch):
    import fastxfer.tensorflow as ftf

    for value, want in [("1", True), ("on", True), ("0", False), ("off", False)]:
        monkeypatch.setenv("FASTXFER_TF_PIN", value)
        assert ftf._pin_enabled() is want
    monkeypatch.setenv("FASTXFER_TF_PIN", "sometimes")
    with pytest.raises(ValueError, match="FASTXFER_TF_PIN"):
        ftf._pin_enabled()
    monkeypatch.setenv("FASTXFER_TF_PIN", "auto")
    monkeypatch.setenv("FASTXFER_ENGINE_CPUS", "1")
    assert ftf._pin_enabled() is True  # the engine has a core of its own
