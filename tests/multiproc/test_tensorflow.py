"""fastxfer.tensorflow through the launcher: collectives on tensors (eager and tf.function),
DistributedGradientTape giving identical weights on every rank that match one process training
on the whole batch."""

import importlib.util
import re

import pytest

from _launch import assert_ok, launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "tf_worker.py"


def test_tensor_collectives_eager_and_graph():
    assert_ok(launch(2, W, "collectives", env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600), 2, "tf collectives")


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_distributed_gradient_tape_matches_single_process(compression):
    lines = assert_ok(launch(2, W, "tape", compression, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600), 2,
                      f"tape {compression}")
    errs = [re.search(r" err (\S+)", line).group(1) for line in lines]
    assert errs[0] == errs[1], lines  # the same weights on both ranks
