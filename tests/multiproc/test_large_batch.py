"""The large-batch toolkit across 2 ranks through the launcher: model averaging and early stopping."""

import importlib.util

import pytest

from _launch import assert_ok, launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def test_model_averaging_callback():
    assert_ok(launch(2, "keras_worker.py", "averaging", env=ENV, timeout=600), 2, "averaging")


def test_early_stopping_stops_all_ranks_together():
    lines = assert_ok(launch(2, "keras_worker.py", "earlystop", env=ENV, timeout=600), 2, "earlystop")
    assert all(line.endswith("epochs 2") for line in lines), lines
