"""fastxfer.tensorflow through the launcher: collectives on tensors (eager and tf.function),
DistributedGradientTape giving identical weights on every rank that match one process training
on the whole batch."""

import importlib.util
import re

import pytest

from _launch import launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "tf_worker.py"


def test_tensor_collectives_eager_and_graph():
    r = launch(2, W, "collectives", env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("OK tf collectives") == 2


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_distributed_gradient_tape_matches_single_process(compression):
    r = launch(2, W, "tape", compression, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    errs = re.findall(rf"OK tape {compression} rank \d err (\S+)", r.stdout)
    assert len(errs) == 2 and errs[0] == errs[1]  # the same weights on both ranks
