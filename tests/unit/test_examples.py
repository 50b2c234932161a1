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


def _transfer_mnist():
    """The example as a module (its driver's summary needs neither TensorFlow nor a launcher)."""
    import importlib.util as iu

    sys.path.insert(0, os.path.join(ROOT, "examples"))  # for its `_common`
    try:
        spec = iu.spec_from_file_location("transfer_mnist", os.path.join(ROOT, "examples", "transfer_mnist.py"))
        mod = iu.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    return mod


def test_job_rates_count_every_rank_over_the_slowest_and_mix_one_epoch_of_each_phase():
    import numpy as np

    tm = _transfer_mnist()
    # per rank: (pretrain images, seconds, finetune images, seconds, unfreeze images, seconds)
    timed = np.array([[1000, 2.0, 800, 1.0, 0, 0.0], [1000, 2.5, 800, 0.5, 0, 0.0]])
    rates, mixed = tm.job_rates(timed, {"pretrain": 2500, "finetune": 2000, "unfreeze": 2000})
    assert rates == {"pretrain": 800.0, "finetune": 1600.0}  # 2000 images / 2.5 s, 1600 / 1.0 s
    assert abs(mixed - 4500 / (2500 / 800 + 2000 / 1600)) < 1e-9


def _result(kind, precision, seed, accuracy, rate):
    return {"kind": kind, "workers": 1 if kind == "1" else 2, "precision": precision, "seed": seed,
            "accuracy": accuracy, "epochs": 8, "identical_weights": kind != "ceiling",
            "phase_images_per_s": {"pretrain": rate / 2, "finetune": rate * 2}, "train_images_per_s": rate}


def test_transfer_summary_shows_the_ceiling_row_and_same_seed_ratios(capsys):
    tm = _transfer_mnist()
    results = []
    for seed, (one, many, ceiling) in enumerate([(1000, 900, 1000), (1200, 1000, 1250), (800, 880, 1100)]):
        results += [_result("1", "float32", seed, 0.88 + seed / 1000, one),
                    _result("n", "float32", seed, 0.885, many), _result("ceiling", "float32", seed, 0.5, ceiling)]
    figures = tm.summarise(results, 2)
    out = capsys.readouterr().out
    assert "2 workers, no communication" in out and "1 worker, whole machine" in out and "medians of 3 seeds" in out
    f = figures[("n", "float32")]
    # medians of the per-seed ratios (0.9, 0.833, 1.1 and 0.9, 0.8, 0.8), not ratios of medians
    assert abs(f["vs_one"] - 0.9) < 1e-12 and abs(f["vs_ceiling"] - 0.8) < 1e-12
    assert "2 workers (float32): 88.5% validation accuracy (88.1% with 1 worker); training at 0.90x the rate of 1 " \
           "worker using the whole machine and 0.80x the no-communication ceiling (per seed: 0.90, 0.83, 1.10; " \
           "0.90, 0.80, 0.80)" in out
    assert "accuracy spread across worker counts and precisions: 0.4 points" in out  # the ceiling's 50% left out
