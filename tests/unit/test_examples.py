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
    [res] = json.loads((tmp_path / "r.json").read_text())
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


def test_job_rates_take_the_median_epoch_over_every_rank_and_mix_one_epoch_of_each_phase():
    import numpy as np

    tm = _transfer_mnist()
    # per phase: (ranks, timed epochs, (seconds, images)); epoch rates: every rank's images / slowest rank's seconds
    pre = np.array([[[2.0, 1000], [1.0, 1000], [4.0, 1000]], [[2.5, 1000], [1.0, 1000], [1.0, 1000]]])
    fine = np.array([[[1.0, 800]], [[0.5, 800]]])
    rates, mixed = tm.job_rates({"pretrain": pre, "finetune": fine}, {"pretrain": 2500, "finetune": 2000,
                                                                     "unfreeze": 2000})
    # pretrain epochs: 2000/2.5 = 800, 2000/1.0 = 2000, 2000/4.0 = 500 -> median 800 (a slow epoch moves nothing)
    assert rates == {"pretrain": 800.0, "finetune": 1600.0}
    assert abs(mixed - 4500 / (2500 / 800 + 2000 / 1600)) < 1e-9


def _result(kind, precision, seed, accuracy, rate, best=None, stop=8):
    return {"kind": kind, "workers": 1 if kind == "1" else 2, "mode": "no-comm" if kind == "ceiling" else "fastxfer",
            "precision": precision, "seed": seed, "accuracy": accuracy, "epochs": 10, "patience": 3,
            "early_stop_accuracy": accuracy if best is None else best, "early_stop_epoch": stop,
            "identical_weights": kind != "ceiling",
            "phase_images_per_s": {"pretrain": rate / 2, "finetune": rate * 2}, "train_images_per_s": rate}


def test_transfer_summary_gives_accuracy_means_rate_medians_and_flags_a_beaten_ceiling(capsys):
    tm = _transfer_mnist()
    results = []
    for seed, (one, many, ceiling) in enumerate([(1000, 900, 1000), (1200, 1000, 1250), (800, 880, 800)]):
        results += [_result("1", "float32", seed, 0.88 + seed / 1000, one, best=0.9, stop=6 + seed),
                    _result("n", "float32", seed, 0.885 + seed / 100, many), _result("ceiling", "float32", seed, 0.5,
                                                                                     ceiling)]
    figures = tm.summarise(results, 2, "RECIPE LINE")
    out = capsys.readouterr().out
    assert "2 workers, no communication" in out and "1 worker, whole machine" in out and "3 seeds (0, 1, 2)" in out
    n, one = figures[("n", "float32")], figures[("1", "float32")]
    # accuracy: means over the seeds (88.5, 89.5, 90.5 and 88.0, 88.1, 88.2); early stopping reported beside
    assert abs(n["accuracy"] - 89.5) < 1e-9 and abs(one["accuracy"] - 88.1) < 1e-9
    assert abs(one["early_stop_accuracy"] - 90.0) < 1e-9 and one["early_stop_epoch"] == 7
    # rates: medians of the per-round ratios (0.9, 0.833, 1.1 to 1 worker; 0.9, 0.8, 1.1 to the ceiling)
    assert abs(n["vs_one"] - 0.9) < 1e-12 and abs(n["vs_ceiling"] - 0.9) < 1e-12
    assert n["vs_ceiling_each"] == [0.9, 0.8, 1.1]
    # the round whose ceiling was beaten is flagged, not printed as a result
    assert "0.90x (0.80-0.90) +1 error" in out and "ceiling was beaten in 1 of 3 rounds: a measurement error" in out
    # per-seed gaps 0.5, 1.4, 2.3: standard error 0.9 / sqrt(3)
    assert abs(n["gap"] - 1.4) < 1e-9 and abs(n["gap_se"] - 0.9 / 3 ** 0.5) < 1e-9
    assert "float32: 2 workers 89.5%, 1 worker 88.1% (means of 3 seeds, 10 fine-tuning epochs each): +1.4 points " \
           "(standard error 0.5 over the seeds), MORE than 1 point apart; training at 0.90x (0.83-1.10) the rate of " \
           "1 worker" in out
    assert "RECIPE LINE" in out


def test_a_ceiling_beaten_in_most_rounds_is_a_measurement_error_without_a_figure(capsys):
    tm = _transfer_mnist()
    results = []
    for seed, (many, ceiling) in enumerate([(1000, 900), (1000, 950), (1000, 1100)]):
        results += [_result("1", "bf16", seed, 0.9, 800), _result("n", "bf16", seed, 0.9, many),
                    _result("ceiling", "bf16", seed, 0.5, ceiling)]
    figures = tm.summarise(results, 2)
    out = capsys.readouterr().out
    assert figures[("n", "bf16")]["vs_ceiling"] is None
    assert "measurement error (2 of 3)" in out and "1.11x" not in out and "1.05x" not in out
    assert "bf16: 2 workers 90.0%, 1 worker 90.0%" in out
    assert "+0.0 points (standard error 0.0 over the seeds), within 1 point" in out


def test_early_stopping_is_worked_out_as_keras_would_stop():
    tm = _transfer_mnist()
    # improvements must be strict; patience 3 stops after three epochs without one
    assert tm.early_stop([0.5, 0.6, 0.6, 0.55, 0.58, 0.7], 3) == (5, 2, 0.6)
    assert tm.early_stop([0.5, 0.6, 0.7], 3) == (3, 3, 0.7)  # never stopped: the last epoch
    assert tm.early_stop([0.9, 0.1], 1) == (2, 1, 0.9)


def test_rounds_take_turns_and_every_other_round_runs_backwards():
    tm = _transfer_mnist()
    plan = tm.rounds(["float32", "bf16"], [0, 1, 2], 2)
    assert [t for t in tm.rounds(["float32"], [0, 1, 2], 2, ceiling_rounds=1) if t[1][2] == "no-comm"] == \
        [(2, ("float32", 0, "no-comm"))]  # the ceiling only times: in the first rounds only
    first = [(1, ("float32", 0, "fastxfer")), (2, ("float32", 0, "fastxfer")), (2, ("float32", 0, "no-comm")),
             (1, ("bf16", 0, "fastxfer")), (2, ("bf16", 0, "fastxfer")), (2, ("bf16", 0, "no-comm"))]
    assert plan[:6] == first
    assert plan[6:12] == [(w, (p, 1, m)) for w, (p, _, m) in reversed(first)]
    assert plan[12:] == [(w, (p, 2, m)) for w, (p, _, m) in first] and len(plan) == 18


def test_worker_tasks_name_what_is_wrong():
    tm = _transfer_mnist()
    args = tm.parse(["--worker", "--tasks", "float32:0:fastxfer, bf16:3:no-comm"])
    assert tm.parse_tasks(args) == [("float32", 0, "fastxfer"), ("bf16", 3, "no-comm")]
    assert tm.parse_tasks(tm.parse(["--worker", "--no-comm", "--seed", "4"])) == [("float32", 4, "no-comm")]
    for bad in ("float64:0:fastxfer", "float32:x:fastxfer", "float32:0:nccl", "float32:0"):
        with pytest.raises(SystemExit, match="is not PRECISION:SEED:MODE"):
            tm.parse_tasks(tm.parse(["--worker", "--tasks", bad]))


def test_the_ratio_to_the_ceiling_takes_the_runs_rate_over_the_ceilings_epochs():
    tm = _transfer_mnist()
    results = []
    for seed in range(3):
        n = _result("n", "float32", seed, 0.9, 1000)
        n["ceiling_window_images_per_s"] = 900  # the run's epochs 2-4, where the ceiling timed
        c = _result("ceiling", "float32", seed, 0.5, 950)
        c["ceiling_window_images_per_s"] = 950
        results += [_result("1", "float32", seed, 0.9, 800), n, c]
    f = tm.summarise(results, 2)[("n", "float32")]
    assert f["vs_ceiling_each"] == [900 / 950] * 3  # not 1000 / 950, a measurement error
    assert f["vs_one_each"] == [1000 / 800] * 3  # to 1 worker: the whole runs
