"""fastxfer's native TensorFlow ops through the launcher: bit-identical to the tf.numpy_function
bridge (eager, tf.function, Keras 3, tf-keras; float32/64, float16, bfloat16, int32/64, bf16
and fp16 wire formats); a buffer reduced in place is one nobody else reads; the timeline holds
every gradient of every step."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _launch import BRIDGE_MODES, assert_ok, launch, script_output

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "tf_native_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


# Each job runs several modes one after the other (TensorFlow starts once). The native ops and the
# bridge are chosen per process (FASTXFER_TF_NATIVE), so each has jobs of its own: shared ones
# (conftest.py: keras3_scripts_job, bridge_scripts_job, tf_keras_scripts_job) and this file's.
NATIVE_MODES = "programs,engine_collectives,forwarding,hold"


def _job(out, modes, native, extra_env=None):
    """A 2-rank job of the worker running `modes`, saving under the prefix `out`."""
    return launch(2, W, modes, str(out), env={**ENV, "FASTXFER_TF_NATIVE": native, **(extra_env or {})}, timeout=900)


@pytest.fixture(scope="module")
def native_job(keras3_scripts_job):
    """(job, output prefix) of NATIVE_MODES through the native ops: the worker's part of the shared
    2-rank Keras 3 job (conftest.py), saving under <its directory>/native."""
    from _launch import KERAS3_SCRIPTS

    assert KERAS3_SCRIPTS["tf_native"][1] == [NATIVE_MODES, "{dir}/native"]
    r, base = keras3_scripts_job
    return script_output(r, "tf_native"), base / "tf_native" / "native"


@pytest.fixture(scope="module")
def bridge_job(bridge_scripts_job):
    """(job, output prefix) of BRIDGE_MODES through the tf.numpy_function bridge: the worker's part of
    the shared 2-rank bridge job (conftest.py), saving under <its directory>/bridge."""
    from _launch import BRIDGE_SCRIPTS

    assert BRIDGE_SCRIPTS["tf_bridge"][1] == [BRIDGE_MODES, "{dir}/bridge"]
    r, base = bridge_scripts_job
    return script_output(r, "tf_bridge"), base / "tf_bridge" / "bridge"


def _results(job, mode, native):
    """Each rank's saved results of `mode` in `job`, after its checks: one `OK <mode>` line from each
    rank, on the path asked for, with nothing left between submit and wait."""
    r, out = job
    lines = assert_ok(r, 2, mode)
    assert all(f"native={native == '1'}" in line for line in lines), lines
    assert all("pending=0" in line for line in lines), lines  # nothing left between submit and wait
    return [dict(np.load(f"{out}-{mode}.{r}.npz")) for r in range(2)]


def _assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs between the native ops and the bridge"


def test_native_ops_match_the_numpy_function_bridge_bit_for_bit(native_job, bridge_job):
    nat = _results(native_job, "programs", "1")
    ref = _results(bridge_job, "programs", "0")
    for r in range(2):
        _assert_bit_identical(nat[r], ref[r])
    _assert_bit_identical(nat[0], nat[1])  # and every rank holds the same results
    # the values are the reductions themselves, not just the same on both paths
    from workers.tf_native_worker import inputs
    ins = [inputs(r) for r in range(2)]
    assert np.array_equal(nat[0]["eager.i64.sum"], ins[0]["i64"] + ins[1]["i64"])
    assert np.array_equal(nat[0]["eager.f32.max"], np.maximum(ins[0]["f32"], ins[1]["f32"]))
    assert np.array_equal(nat[0]["eager.gather"], np.concatenate([ins[0]["i32"][:5], ins[1]["i32"][:8]]))
    assert np.array_equal(nat[0]["eager.bcast"], ins[1]["f64"])


def test_new_dtypes_alltoall_and_reducescatter_native_match_bridge_and_exact_values(native_job, bridge_job):
    """New dtypes and Product, alltoall, reducescatter (grouped, compressed), their gradients,
    eager and in tf.function: native ops == numpy_function bridge, bit for bit, and the values."""
    nat = _results(native_job, "engine_collectives", "1")
    ref = _results(bridge_job, "engine_collectives", "0")
    for r in range(2):
        _assert_bit_identical(nat[r], ref[r])
    a, b = nat
    x = [np.arange(12, dtype=np.float32).reshape(6, 2) + 100 * r for r in range(2)]
    u8 = [np.arange(200, 213) * (r + 1) % 256 for r in range(2)]
    assert a["eager.uint8.sum"].tolist() == ((u8[0] + u8[1]) % 256).tolist()  # wraps
    assert a["eager.uint8.average"].tolist() == (((u8[0] + u8[1]) % 256) // 2).tolist()
    assert a["eager.uint8.product"].tolist() == ((u8[0] * u8[1]) % 256).tolist()
    assert a["eager.int8.sum"].dtype == np.int8 and a["eager.bool.sum"].dtype == bool
    assert a["eager.bool.sum"].tolist() == ((u8[0] % 2) | (u8[1] % 2)).astype(bool).tolist()
    assert a["eager.bool.min"].tolist() == ((u8[0] % 2) & (u8[1] % 2)).astype(bool).tolist()
    assert a["eager.uint16.gather"].tolist() == u8[0][:3].tolist() + u8[1][:4].tolist()
    assert a["eager.f32.product"].tolist() == [4.5, 8.0, 18.0]
    assert np.array_equal(a["eager.a2a.even"], np.concatenate([x[0][:3], x[1][:3]]))
    assert np.array_equal(b["eager.a2a.even"], np.concatenate([x[0][3:], x[1][3:]]))
    assert np.array_equal(a["eager.a2a.uneven"], np.concatenate([x[0][:2], x[1][:3]]))
    assert a["eager.a2a.uneven.splits"].tolist() == [2, 3] and b["eager.a2a.uneven.splits"].tolist() == [0, 0]
    assert a["eager.a2a.uneven.splits"].dtype == np.int32 and b["eager.a2a.uneven"].shape == (0, 2)
    assert a["eager.a2a.empty"].shape == (0, 2) and a["eager.a2a.empty.splits"].tolist() == [0, 0]
    full = np.arange(10, dtype=np.float64).reshape(5, 2) * 3
    assert np.array_equal(a["eager.rs.sum"], full[:3]) and np.array_equal(b["eager.rs.sum"], full[3:])
    # int32 average as Horovod: (7*1 + 7*2) / 2 = 10.5 -> 10, (-3 + -6) / 2 = -4.5 -> -4
    assert a["eager.rs.avg.i32"].tolist() == [[10], [-4]] and b["eager.rs.avg.i32"].tolist() == [[1]]
    assert a["eager.grs.0"].tolist() == [[3, 3], [3, 3]] and b["eager.grs.1"].tolist() == [2, 2]
    # gradient: alltoall back (2*o to its senders) + reducescatter(Average)'s allgather of 2*y*2
    for r, res in enumerate(nat):
        xs = x
        o_of = {0: np.concatenate([xs[0][:1], xs[1][:1]]), 1: np.concatenate([xs[0][1:], xs[1][1:]])}
        back = np.concatenate([2 * o_of[0][r:r + 1], 2 * o_of[1][5 * r:5 * r + 5]])
        y = (2 * xs[0] + 2 * xs[1]) / 2
        want = back + 2 * np.concatenate([2 * y[:3], 2 * y[3:]])
        assert np.allclose(res["eager.grad"], want), (r, res["eager.grad"], want)
    for step in range(2):
        assert a[f"graph.{step}.1"].tolist() == [1, 2] and b[f"graph.{step}.1"].tolist() == [5, 4]
        assert a[f"graph.{step}.5"].tolist() == [0, 4, 9] and a[f"graph.{step}.6"].tolist() == [True, True, True]
        assert np.array_equal(a[f"graph.{step}.3"], (2 * x[0] + 2 * x[1])[:3])
        _assert_bit_identical({k: v for k, v in a.items() if k.startswith(f"graph.{step}.")},
                              {k.replace("graph.0.", f"graph.{step}."): v for k, v in a.items()
                               if k.startswith("graph.0.")})


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed")
def test_tf_keras_native_matches_bridge(tmp_path, request):
    """A tf-keras model's step through the native ops (in the shared tf-keras job, conftest.py) and
    through the bridge (a job of its own: the bridge is chosen per process)."""
    legacy = {"TF_USE_LEGACY_KERAS": "1"}
    r, base = request.getfixturevalue("tf_keras_scripts_job")
    nat = _results((script_output(r, "tf_native_legacy"), base / "tf_native_legacy" / "native"), "legacy", "1")
    ref = _results((_job(tmp_path / "bridge", "legacy", "0", legacy), tmp_path / "bridge"), "legacy", "0")
    _assert_bit_identical(nat[0], ref[0])
    _assert_bit_identical(nat[0], nat[1])


def test_forwarded_buffers_are_never_read_after_the_reduction(native_job):
    assert_ok(native_job[0], 2, "forwarding")


def test_grouped_submits_hold_to_one_round_per_bucket(native_job):
    assert_ok(native_job[0], 2, "hold")


def test_timeline_is_chrome_trace_with_every_gradient_of_every_step(tmp_path):
    path = tmp_path / "tl.json"
    lines = assert_ok(launch(2, W, "timeline", env={**ENV, "FASTXFER_TIMELINE": str(path)}, timeout=600), 2,
                      "timeline")
    n_vars = len(json.loads(lines[0].split(" vars ", 1)[1]))
    job = json.loads(path.read_text())  # the job's one file, valid JSON: written by rank 0 at shutdown
    assert sorted(os.listdir(tmp_path)) == ["tl.json"]
    for rank in (0, 1):
        events = [e for e in job if e["pid"] == rank]  # each rank's row
        lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        reduce = [e for e in events if e["ph"] == "X" and e["name"] == "allreduce"]
        grads = {lanes[e["tid"]] for e in reduce}
        assert len(grads) == n_vars, (grads, n_vars)  # a lane per gradient...
        assert len(reduce) == n_vars * 3  # ...reduced in each of the 3 steps
        for e in reduce:
            assert e["dur"] >= 0 and e["args"]["bucket"].startswith("bucket ")
        marks = [e["name"] for e in events if e["ph"] == "i"]
        assert marks[:2] == ["step 0 begins", "step 0 ends"] and len(marks) == 6, marks
        assert any(e["name"] == "negotiate" for e in events)
    png = tmp_path / "step.png"  # and `fastxfer bench timeline` draws and summarises a step of it
    r = subprocess.run([sys.executable, "-m", "fastxfer.cli", "bench", "timeline", str(path), "--step", "1", "--plot",
                        str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step 1: " in r.stdout and f"{n_vars} tensors in " in r.stdout, r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_op_library_loads_in_a_fresh_process():
    code = ("import warnings; warnings.simplefilter('error');"
            "import fastxfer.tensorflow.native as n; lib = n.library();"
            "assert lib is not None, n.reason();"
            "print(sorted(x for x in dir(lib) if x.startswith('fastxfer') and not x.endswith('_fallback')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=None)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("['fastxfer_submit', 'fastxfer_submit_splits', 'fastxfer_wait', 'fastxfer_wait_alltoall', "
            "'fastxfer_wait_gather']") in r.stdout
