"""Process sets (Horovod's ProcessSet, add/remove_process_set, process_set= on every collective and
on DistributedOptimizer / DistributedGradientTape): 3 ranks through the launcher, sets [0, 2], [1]
and [1, 2]; every result against values computed by hand (tests/workers/process_sets_worker.py)."""

import importlib.util
import re

import pytest

from _launch import assert_ok, launch, mpi_launch, needs_mpi, script_output

W = "process_sets_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def test_numpy_collectives_on_process_sets_registration_and_removal():
    """Every collective in a set, sets running concurrently with each other and with the global set,
    Horovod's repr and the queries on every rank, NotInProcessSetError from every collective kind
    on a set this rank is not in (the next collective works), errors that name the problem, removal
    (unmapped, collectives on it name its id, removing twice refused, ids not reused),
    init(process_sets=...)."""
    assert_ok(launch(3, W, "numpy", env=ENV), 3, "numpy")


def test_ranks_that_disagree_on_a_set_fail_every_rank_and_a_failed_set_leaves_the_job_running():
    assert_ok(launch(3, W, "mismatch", env=ENV), 3, "mismatch")


def test_set_segment_names_are_random_and_an_uneven_removal_keeps_the_registry_consistent():
    """Issue 34 rows 2 and 9: files planted at the names a set's segment would once have had do not
    stop add_process_set, and each registration's name is 128 fresh random bits; removing a set
    while only rank 1 has a request in flight on it raises MismatchError on every rank, and the set
    is removed everywhere, so the same ranks register again."""
    assert_ok(launch(3, W, "registry", env=ENV), 3, "registry")


def test_a_rank_that_exits_while_a_set_peer_waits_fails_the_job_promptly():
    r = launch(3, W, "leaves", env={**ENV, "FASTXFER_TIMEOUT": "120"})
    out = r.stdout + r.stderr
    # the set's engine names rank 1 by its rank in the job (it is the set's first rank)
    m = re.search(r"FAILED rank 2 after ([\d.]+)s: PeerFailureError: rank 1 failed: the process left without "
                  r"calling shutdown\(\)", r.stdout)
    assert m and float(m[1]) < 30, out  # not the 120 s timeout
    assert "RuntimeError: rank 1 gives up" in r.stderr
    assert re.search(r"fastxfer run: job failed: .*rank 1(: exit code 1| failed first \(exit code 1\))", r.stderr), out
    assert r.returncode != 0


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
@pytest.mark.parametrize("native", ["1", "0"], ids=["native-ops", "numpy_function-bridge"])
def test_tensorflow_and_keras_in_process_sets(native, request):
    """hvd collectives eager and in tf.function, size_op/process_set_included_op, objects,
    DistributedGradientTape and DistributedOptimizer(process_set=...) on a Keras model; a rank
    outside the set keeps its own gradients (tape, model.fit, apply_gradients; eager and traced;
    exact values); every collective on a set this rank is not in raises an error that is both
    tf.errors.InvalidArgumentError and fx.FastxferError; removed and duplicate sets."""
    if native == "1":  # in the shared 3-rank Keras 3 job (conftest.py); the bridge is chosen per process
        r = script_output(request.getfixturevalue("keras3_three_ranks_job")[0], "process_sets_tensorflow", 3)
    else:
        r = launch(3, W, "tensorflow", env={**ENV, "FASTXFER_TF_NATIVE": native}, timeout=600)
    assert_ok(r, 3, "tensorflow")


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed")
def test_tf_keras_distributed_optimizer_in_process_sets():
    r = launch(3, W, "tensorflow", env={**ENV, "TF_USE_LEGACY_KERAS": "1"}, timeout=600)
    assert_ok(r, 3, "tensorflow")


@needs_mpi
def test_process_sets_across_emulated_hosts_under_mpirun():
    """4 ranks on 2 emulated hosts: sets across hosts (MPI sub-communicator), inside a host, and an
    uneven one, refused on every rank."""
    r = mpi_launch(4, W, "hosts", per_host=2, env=ENV)
    assert_ok(r, 4, "hosts")
