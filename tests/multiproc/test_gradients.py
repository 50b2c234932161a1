"""Gradients through the public collectives (issue 32 item 4), as Horovod defines them, with exact
values on every rank, eagerly and in a tf.function, on the whole job and in a process set
(tests/workers/gradients_worker.py)."""

import importlib.util

import pytest

from _launch import assert_ok, launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_through_allreduce_grouped_allgather_broadcast(n):
    assert_ok(launch(n, "gradients_worker.py", env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600), n, "gradients")
