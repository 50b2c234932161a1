"""Horovod parity (issue 15), through the launcher on 2 ranks: the names and semantics of
horovod.tensorflow / horovod.tensorflow.keras that fastxfer adds, each checked against exact values
(identical weights across ranks, reductions and updates computed by hand), on Keras 3 and on
tf-keras models; and Horovod's published TensorFlow 2 examples, shortened, run to the end with
only their import changed (tests/workers/horovod_examples/)."""

import importlib.util
import os
import re

import pytest

from _launch import (HVD_PARTIAL, HVD_SPARSE, HVD_SYNTHETIC_ARGS, KERAS3_SCRIPTS, TF_KERAS_SCRIPTS, assert_ok,
                     mpi_launch, needs_mpi, script_output)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "hvd_parity_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
TF_KERAS = pytest.param(
    "tf-keras", marks=pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed"))
FLAVOURS = ["keras3", TF_KERAS]


def flavour_job(request, flavour):
    """(CompletedProcess, directory) of the shared 2-rank job of `flavour` (conftest.py)."""
    return request.getfixturevalue("tf_keras_scripts_job" if flavour == "tf-keras" else "keras3_scripts_job")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_keras_and_tensorflow_front_ends(flavour, request):
    """In the shared 2-rank job of each Keras flavour (conftest.py): BroadcastGlobalVariablesCallback
    on a lazily built model and with local_variables; local layers keeping their gradients
    (PartialDistributedOptimizer, register_local_var, PartialDistributedGradientTape); the learning
    rate callbacks and BestModelCheckpoint; queries; Horovod's signatures; sparse gradients
    allgathered or densified."""
    job, base = flavour_job(request, flavour)
    r = script_output(job, "hvd_front_ends")
    for tag in ["lazybcast", "localbcast", *[m.replace("-", " ") for m in HVD_PARTIAL], "lrcallbacks", "queries",
                "signatures"]:
        assert_ok(r, 2, tag)
    for m in HVD_SPARSE:
        for dense in (False, True):
            assert_ok(r, 2, f"sparse {m.split('-', 1)[1]} sparse_as_dense={dense}")
    # rank 0 alone wrote, and only at the epochs whose averaged score improved (1, 2 and 4)
    assert sorted(os.listdir(base / "hvd_front_ends" / "best")) == ["best-0-1.h5", "best-0-2.h5", "best-0-4.h5"]


@needs_mpi
@pytest.mark.parametrize("np_,per_host", [(2, 2), (4, 2)])
def test_host_queries_under_mpirun(np_, per_host):
    """cross_rank/cross_size from the layout, mpi_enabled and mpi_threads_supported under mpirun,
    with hosts emulated by FASTXFER_HOST_ID (one host for 2 ranks, two hosts for 4)."""
    assert_ok(mpi_launch(np_, W, f"hostqueries-{per_host}", per_host=per_host, env=ENV, timeout=600), np_,
              "hostqueries")


# -- Horovod's examples, only the import changed ---------------------------------------------------
# They run in the shared 2-rank job of their Keras flavour (conftest.py; tests/workers/run_scripts.py:
# TensorFlow starts once), each in a directory of its own; each test checks its example's part of the output.


def run_example(request, flavour, name, args=()):
    """(its output, its directory) of Horovod example `name` under `flavour`, from the job that ran it."""
    table = TF_KERAS_SCRIPTS if flavour == "tf-keras" else KERAS3_SCRIPTS
    assert table[name] == (f"tests/workers/horovod_examples/{name}.py", list(args))
    r, base = flavour_job(request, flavour)
    return script_output(r, name), base / name


def final_lines(r):
    """The FINAL line each rank prints after training (weights digest, averaged loss), by rank."""
    found = dict(re.findall(r"^\[\s*(\d+)\] FINAL rank \d+ (.*)$", r.stdout, re.M))
    assert r.returncode == 0 and sorted(found) == ["0", "1"], r.stdout[-3000:] + r.stderr[-3000:]
    return found


@pytest.mark.parametrize("flavour", [TF_KERAS])  # on Keras 3 it fails before fastxfer: legacy optimizers are gone
def test_example_tensorflow2_keras_mnist(flavour, request):
    r, cwd = run_example(request, flavour, "tensorflow2_keras_mnist")
    final = final_lines(r)
    assert final["0"] == final["1"], final  # identical weights and averaged loss on both ranks
    assert "Epoch 3: finished gradual learning rate warmup to 0.002." in r.stdout
    assert sorted(os.listdir(cwd)) == [f"checkpoint-{e}.h5" for e in range(1, 5)]  # rank 0's


@pytest.mark.parametrize("flavour", [TF_KERAS])  # calls opt.variables(): a list, not callable, on Keras 3
def test_example_tensorflow2_mnist(flavour, request):
    r, cwd = run_example(request, flavour, "tensorflow2_mnist")
    final = final_lines(r)
    assert final["0"] == final["1"], final
    assert "Step #4\tLoss:" in r.stdout and "checkpoints-1.index" in os.listdir(cwd)


@pytest.mark.parametrize("flavour", ["keras3", TF_KERAS])  # on Keras 3 experimental_run_tf_function is its only problem
def test_example_tensorflow2_keras_synthetic_benchmark(flavour, request):
    r, _ = run_example(request, flavour, "tensorflow2_keras_synthetic_benchmark", HVD_SYNTHETIC_ARGS)
    final = final_lines(r)
    assert final["0"] == final["1"], final  # trainable weights identical on both ranks
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", r.stdout), r.stdout[-2000:]


@pytest.mark.parametrize("flavour", [TF_KERAS])  # calls opt.variables(): a list, not callable, on Keras 3
def test_example_tensorflow2_synthetic_benchmark(flavour, request):
    r, _ = run_example(request, flavour, "tensorflow2_synthetic_benchmark", HVD_SYNTHETIC_ARGS)
    final = final_lines(r)
    assert final["0"] == final["1"], final
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", r.stdout), r.stdout[-2000:]


@pytest.mark.parametrize("n", [2, 3])
def test_alltoall_reducescatter_join_front_ends(n, request):
    # in the shared Keras 3 jobs of 2 and 3 ranks (conftest.py)
    job = request.getfixturevalue({2: "keras3_scripts_job", 3: "keras3_three_ranks_job"}[n])[0]
    r = script_output(job, "hvd_collectives", n)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(ln.split("] ", 1)[1] for ln in r.stdout.splitlines() if "OK hvd" in ln) == \
        [f"OK hvd collectives rank {j}" for j in range(n)]


@pytest.mark.parametrize("n,native", [(2, "1"), (3, "1"), (2, "0")],
                         ids=["2-ranks-native-ops", "3-ranks-native-ops", "2-ranks-numpy_function-bridge"])
def test_a_collective_whose_ranks_disagree_fails_alone_and_the_next_one_works(n, native, request):
    """allreduce (dtype, op, Product, int8/uint8), grouped_allreduce, allgather, grouped_allgather,
    broadcast (root), alltoall, reducescatter, grouped_reducescatter, broadcast_variables, sparse
    allreduce and DistributedGradientTape, eagerly and in a tf.function: the collective fails on every
    rank with FailedPreconditionError (eagerly also fx.MismatchError) naming the ranks and what
    differs, and the next collective of the same kind, under the same name, gives its exact result;
    allgather_object and broadcast_object with names that differ fail their process set
    (tests/workers/hvd_mismatch_worker.py)."""
    if native == "1":  # in the shared Keras 3 jobs (conftest.py); the bridge is chosen per process: a job of its own
        job = request.getfixturevalue({2: "keras3_scripts_job", 3: "keras3_three_ranks_job"}[n])[0]
        r = script_output(job, "hvd_mismatch", n)
    else:
        r = script_output(request.getfixturevalue("bridge_scripts_job")[0], "hvd_mismatch")
    for line in assert_ok(r, n, "mismatches"):
        assert line.endswith(": 30 cases"), line


@pytest.mark.parametrize("n,native", [(2, "1"), (3, "1"), (2, "0")],
                         ids=["2-ranks-native-ops", "3-ranks-native-ops", "2-ranks-numpy_function-bridge"])
def test_every_dtype_scaling_rule_adasum_and_a_loop_that_catches_an_expected_error(n, native, request):
    """Every dtype through allreduce/allgather/broadcast/alltoall/reducescatter, bool included;
    integer pre/postscale in float64 truncated toward zero, float16/bfloat16 in float32, Average on
    integers; Adasum (allreduce, grouped, tape) against a float64 reference, the same bits on every
    rank; a training loop catching FailedPreconditionError around a bad allgather and training on to
    identical weights (tests/workers/hvd_dtypes_worker.py), eagerly and in a tf.function."""
    if native == "1":
        job = request.getfixturevalue({2: "keras3_scripts_job", 3: "keras3_three_ranks_job"}[n])[0]
        r = script_output(job, "hvd_dtypes", n)
    else:
        r = script_output(request.getfixturevalue("bridge_scripts_job")[0], "hvd_dtypes")
    for line in assert_ok(r, n, "hvd dtypes"):
        assert line.endswith(": 125 checks"), line
