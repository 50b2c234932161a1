"""Horovod parity (issue 15), through the launcher on 2 ranks: the names and semantics of
horovod.tensorflow / horovod.tensorflow.keras that fastxfer adds, each checked against exact values
(identical weights across ranks, reductions and updates computed by hand), on Keras 3 and on
tf-keras models; and Horovod's published TensorFlow 2 examples, shortened, run to the end with
only their import changed (tests/workers/horovod_examples/)."""

import importlib.util
import os
import re

import pytest

from _launch import KERAS3_SCRIPTS, WORKERS, assert_ok, launch, launch_scripts, mpi_launch, needs_mpi, script_output

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "hvd_parity_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
TF_KERAS = pytest.param(
    "tf-keras", marks=pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed"))
FLAVOURS = ["keras3", TF_KERAS]


def env(flavour):
    return {**ENV, "TF_USE_LEGACY_KERAS": "1" if flavour == "tf-keras" else "0"}


PARTIAL = ["partial-fit", "partial-eager", "partial-register", "partialtape-eager", "partialtape-function"]
SPARSE = ["sparse-tape-eager", "sparse-tape-function", "sparse-fit"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_keras_and_tensorflow_front_ends(flavour, tmp_path):
    """One job per Keras flavour (TensorFlow starts once for all of them): BroadcastGlobalVariablesCallback
    on a lazily built model and with local_variables; local layers keeping their gradients
    (PartialDistributedOptimizer, register_local_var, PartialDistributedGradientTape); the learning
    rate callbacks and BestModelCheckpoint; queries; Horovod's signatures; sparse gradients
    allgathered or densified."""
    modes = ["lazybcast", "localbcast", *PARTIAL, "lrcallbacks", "queries", "signatures", *SPARSE]
    r = launch(2, W, ",".join(modes), str(tmp_path), env=env(flavour), timeout=900)
    for tag in ["lazybcast", "localbcast", *[m.replace("-", " ") for m in PARTIAL], "lrcallbacks", "queries",
                "signatures"]:
        assert_ok(r, 2, tag)
    for m in SPARSE:
        for dense in (False, True):
            assert_ok(r, 2, f"sparse {m.split('-', 1)[1]} sparse_as_dense={dense}")
    # rank 0 alone wrote, and only at the epochs whose averaged score improved (1, 2 and 4)
    assert sorted(os.listdir(tmp_path)) == ["best-0-1.h5", "best-0-2.h5", "best-0-4.h5"]


@needs_mpi
@pytest.mark.parametrize("np_,per_host", [(2, 2), (4, 2)])
def test_host_queries_under_mpirun(np_, per_host):
    """cross_rank/cross_size from the layout, mpi_enabled and mpi_threads_supported under mpirun,
    with hosts emulated by FASTXFER_HOST_ID (one host for 2 ranks, two hosts for 4)."""
    assert_ok(mpi_launch(np_, W, f"hostqueries-{per_host}", per_host=per_host, env=ENV, timeout=600), np_,
              "hostqueries")


# -- Horovod's examples, only the import changed ---------------------------------------------------
# The tf-keras examples run one after the other in one job (tests/workers/run_scripts.py: TensorFlow
# starts once), each in a directory of its own; each test checks its example's part of the output.

EXAMPLES = os.path.join(WORKERS, "horovod_examples")
SYNTHETIC_ARGS = ["--no-cuda", "--fp16-allreduce"]
TF_KERAS_EXAMPLES = {  # name: arguments
    "tensorflow2_keras_mnist": [],
    "tensorflow2_mnist": [],
    "tensorflow2_keras_synthetic_benchmark": SYNTHETIC_ARGS,
    "tensorflow2_synthetic_benchmark": SYNTHETIC_ARGS,
}


def _examples_job(flavour, examples, base):
    """One run_scripts.py job of `examples` ({name: args}), each in base/<name>; returns (job, base)."""
    for name in examples:
        (base / name).mkdir()
    return launch_scripts(2, [(name, base / name, os.path.join(EXAMPLES, f"{name}.py"), args)
                              for name, args in examples.items()], env=env(flavour), timeout=900), base


@pytest.fixture(scope="module")
def tf_keras_examples(tmp_path_factory):
    return _examples_job("tf-keras", TF_KERAS_EXAMPLES, tmp_path_factory.mktemp("hvd_examples"))


def run_example(request, flavour, name, args=()):
    """(its output, its directory) of Horovod example `name` under `flavour`, from the job that ran it."""
    if flavour == "tf-keras":
        r, base = request.getfixturevalue("tf_keras_examples")
        assert TF_KERAS_EXAMPLES[name] == list(args)
    else:  # the shared Keras 3 job (conftest.py)
        r, base = request.getfixturevalue("keras3_scripts_job")
        assert KERAS3_SCRIPTS[name][1] == list(args)
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
    r, _ = run_example(request, flavour, "tensorflow2_keras_synthetic_benchmark", SYNTHETIC_ARGS)
    final = final_lines(r)
    assert final["0"] == final["1"], final  # trainable weights identical on both ranks
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", r.stdout), r.stdout[-2000:]


@pytest.mark.parametrize("flavour", [TF_KERAS])  # calls opt.variables(): a list, not callable, on Keras 3
def test_example_tensorflow2_synthetic_benchmark(flavour, request):
    r, _ = run_example(request, flavour, "tensorflow2_synthetic_benchmark", SYNTHETIC_ARGS)
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
    if native == "1":  # in the shared Keras 3 jobs (conftest.py); the bridge is chosen per process
        job = request.getfixturevalue({2: "keras3_scripts_job", 3: "keras3_three_ranks_job"}[n])[0]
        r = script_output(job, "hvd_mismatch", n)
    else:
        r = launch(n, "hvd_mismatch_worker.py", env={**ENV, "FASTXFER_TF_NATIVE": native}, timeout=600)
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
        r = launch(n, "hvd_dtypes_worker.py", env={**ENV, "FASTXFER_TF_NATIVE": native}, timeout=600)
    for line in assert_ok(r, n, "hvd dtypes"):
        assert line.endswith(": 125 checks"), line
