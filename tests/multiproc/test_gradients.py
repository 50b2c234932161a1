"""Gradients through the public collectives (issue 32 item 4), as Horovod defines them, with exact
values on every rank, eagerly and in a tf.function, on the whole job and in a process set
(tests/workers/gradients_worker.py)."""

import importlib.util

import pytest

from _launch import assert_ok, script_output

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_through_allreduce_grouped_allgather_broadcast(n, request):
    # in the shared Keras 3 jobs of 2 and 3 ranks (conftest.py)
    job = request.getfixturevalue({2: "keras3_scripts_job", 3: "keras3_three_ranks_job"}[n])[0]
    assert_ok(script_output(job, "gradients", n), n, "gradients")
