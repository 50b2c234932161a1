"""The transfer-learning example's single-worker path (`--worker` without the launcher) from a
Keras ResNet-50 weights file on disk."""

import importlib.util
import json
import os
import sys

import pytest

from _launch import ROOT, run_command

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None
                                or importlib.util.find_spec("mlxtend") is None,
                                reason="TensorFlow and mlxtend are needed")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_transfer_learning_from_a_resnet50_weights_file(tmp_path):
    """The --weights path: a Keras ResNet-50 (include_top=False) weights file from disk."""
    code = (f"import keras; keras.applications.ResNet50(include_top=False, weights=None, input_shape=(32, 32, 3), "
            f"pooling='avg').save_weights({str(tmp_path / 'r50.weights.h5')!r})")
    r = run_command([sys.executable, "-c", code], timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    out = run_command([sys.executable, os.path.join(ROOT, "examples", "transfer_mnist.py"), "--worker",
                       "--weights", str(tmp_path / "r50.weights.h5"), "--limit", "64", "--epochs", "1",
                       "--json", str(tmp_path / "r.json")], timeout=900, env=ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["workers"] == 1 and res["epochs"] == 1 and res["pretrain_s"] < 1.0  # no pretraining with weights
