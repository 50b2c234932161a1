"""fastxfer.tensorflow through the launcher: collectives on tensors (eager and tf.function),
DistributedGradientTape giving identical weights on every rank that match one process training
on the whole batch."""

import importlib.util
import re

import pytest

from _launch import assert_ok, script_output

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")


@pytest.fixture(scope="module")
def tf_job(keras3_scripts_job):
    """The worker's part of the shared 2-rank Keras 3 job (conftest.py), run with "collectives",
    "tape=none", "tape=bf16": TensorFlow starts once, not once a test."""
    return script_output(keras3_scripts_job[0], "tf_collectives_and_tape")


def test_tensor_collectives_eager_and_graph(tf_job):
    assert_ok(tf_job, 2, "tf collectives")


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_distributed_gradient_tape_matches_single_process(tf_job, compression):
    lines = assert_ok(tf_job, 2, f"tape {compression}")
    errs = [re.search(r" err (\S+)", line).group(1) for line in lines]
    assert errs[0] == errs[1], lines  # the same weights on both ranks
