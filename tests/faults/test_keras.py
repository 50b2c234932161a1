"""fastxfer.keras under bad input, through the launcher: models that differ raise MismatchError on
every rank, naming the variable."""

import importlib.util
import re

import pytest

from _launch import assert_ok, launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "keras_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def test_models_that_differ_raise_mismatch_on_every_rank():
    lines = assert_ok(launch(2, W, "mismatch", env=ENV, timeout=900), 2, "mismatch")
    for line in lines:
        assert re.search(r"OK mismatch rank \d: MismatchError.*'DistributedOptimizer\.\d+\.(bias|kernel)'", line), line
