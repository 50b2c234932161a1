"""Shortened runs of the three reference workloads in examples/ (issue 7), end to end through
`fastxfer run`: each must finish, report its figures and leave the same weights everywhere."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None
                                or importlib.util.find_spec("mlxtend") is None,
                                reason="TensorFlow and mlxtend are needed")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _run(script, *args, timeout=900):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], capture_output=True,
                       text=True, timeout=timeout, cwd="/", env=ENV)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def test_transfer_learning_main_job_short():
    out = _run("transfer_mnist.py", "--limit", "300", "--pretrain-epochs", "1", "--epochs", "3", "--patience", "1")
    results = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", out)]
    assert [r["workers"] for r in results] == [1, 2]
    for r in results:
        assert r["identical_weights"] and 0.0 <= r["accuracy"] <= 1.0 and 1 <= r["epochs"] <= 3
        assert r["images_per_s"] > 0
    assert re.search(r"2 workers \(float32\): [\d.]+% validation accuracy in [\d.]+ s, [\d.]+x the speed of one worker",
                     out), out[-2000:]


def test_batch_size_study_short(tmp_path):
    out = _run("batch_size_study.py", "--batch-sizes", "32,256", "--epochs", "1", "--limit", "1024",
               "--out", str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    got = {(r["recipe"], r["batch"]) for r in res["results"]}
    assert got == {(rec, b) for rec in ["plain", "linear+warmup", "LARS"] for b in (32, 256)}
    lrs = {(r["recipe"], r["batch"]): r["lr"] for r in res["results"]}
    assert lrs[("plain", 256)] == 0.02 and abs(lrs[("linear+warmup", 256)] - 0.16) < 1e-12  # linear scaling
    assert (tmp_path / "batch_size_study.png").stat().st_size > 10_000
    assert "Test accuracy after 1 epochs" in out


@pytest.mark.skipif(importlib.util.find_spec("simplejpeg") is None or importlib.util.find_spec("skimage") is None,
                    reason="the packed JPEG pipeline needs simplejpeg and scikit-image")
def test_efficientnet_on_packed_jpegs_short(tmp_path):
    out_json = tmp_path / "r.json"
    _run("efficientnet_photos.py", "--train-images", "64", "--val-images", "32", "--epochs", "1",
         "--image-size", "32", "--json", str(out_json))
    r = json.loads(out_json.read_text())
    assert r["workers"] == 2 and r["sync_bn_layers"] == 49 and 0.0 <= r["val_accuracy"] <= 1.0
    assert r["images_per_s"] > 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_transfer_learning_from_a_resnet50_weights_file(tmp_path):
    """The --weights path: a Keras ResNet-50 (include_top=False) weights file from disk."""
    code = (f"import keras; keras.applications.ResNet50(include_top=False, weights=None, input_shape=(32, 32, 3), "
            f"pooling='avg').save_weights({str(tmp_path / 'r50.weights.h5')!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "transfer_mnist.py"), "--worker",
                          "--weights", str(tmp_path / "r50.weights.h5"), "--limit", "64", "--epochs", "1",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=900,
                         env=ENV, cwd="/")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["workers"] == 1 and res["epochs"] == 1 and res["pretrain_s"] < 1.0  # no pretraining with weights
