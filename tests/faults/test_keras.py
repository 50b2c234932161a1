"""fastxfer.keras under bad input, through the launcher: models that differ raise MismatchError on
every rank, naming the variable."""

import importlib.util
import re

import pytest

from _launch import assert_ok, script_output

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")


def test_models_that_differ_raise_mismatch_on_every_rank(keras3_scripts_job):
    # keras_worker.py mismatch, the last script of the shared 2-rank Keras 3 job (conftest.py)
    lines = assert_ok(script_output(keras3_scripts_job[0], "keras_mismatch", ends_the_job=True), 2, "mismatch")
    for line in lines:
        assert re.search(r"OK mismatch rank \d: MismatchError.*'DistributedOptimizer\.\d+\.(bias|kernel)'", line), line
