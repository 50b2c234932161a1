"""The large-batch toolkit across 2 ranks through the launcher: model averaging and early stopping."""

import importlib.util

import pytest

from _launch import assert_ok

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")


def test_model_averaging_callback(keras_job):
    assert_ok(keras_job[0], 2, "averaging")


def test_early_stopping_stops_all_ranks_together(keras_job):
    lines = assert_ok(keras_job[0], 2, "earlystop")
    assert all(line.endswith("epochs 2") for line in lines), lines
