"""fastxfer's native TensorFlow ops through the launcher: bit-identical to the tf.numpy_function
bridge (eager, tf.function, Keras 3, tf-keras; float32/64, float16, bfloat16, int32/64, bf16
and fp16 wire formats); a buffer reduced in place is one nobody else reads; the timeline holds
every gradient of every step."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from _launch import assert_ok, launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
W = "tf_native_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _run(tmp_path, mode, native, extra_env=None):
    out = tmp_path / f"{mode}-{native}"
    lines = assert_ok(launch(2, W, mode, str(out), env={**ENV, "FASTXFER_TF_NATIVE": native, **(extra_env or {})},
                             timeout=900), 2, "programs")
    assert all(f"native={native == '1'}" in line for line in lines), lines
    assert all("pending=0" in line for line in lines), lines  # nothing left between submit and wait
    return [dict(np.load(f"{out}.{r}.npz")) for r in range(2)]


def _assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs between the native ops and the bridge"


def test_native_ops_match_the_numpy_function_bridge_bit_for_bit(tmp_path):
    nat = _run(tmp_path, "programs", "1")
    ref = _run(tmp_path, "programs", "0")
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


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed")
def test_tf_keras_native_matches_bridge(tmp_path):
    legacy = {"TF_USE_LEGACY_KERAS": "1"}
    nat = _run(tmp_path, "legacy", "1", legacy)
    ref = _run(tmp_path, "legacy", "0", legacy)
    _assert_bit_identical(nat[0], ref[0])
    _assert_bit_identical(nat[0], nat[1])


def test_forwarded_buffers_are_never_read_after_the_reduction():
    assert_ok(launch(2, W, "forwarding", env=ENV, timeout=600), 2, "forwarding")


def test_timeline_is_chrome_trace_with_every_gradient_of_every_step(tmp_path):
    path = tmp_path / "tl.json"
    lines = assert_ok(launch(2, W, "timeline", env={**ENV, "FASTXFER_TIMELINE": str(path)}, timeout=600), 2,
                      "timeline")
    n_vars = len(json.loads(lines[0].split(" vars ", 1)[1]))
    for rank, p in ((0, path), (1, tmp_path / "tl.1.json")):
        events = json.loads(p.read_text())  # valid JSON: the array is closed at shutdown
        assert all(e["pid"] == rank for e in events)
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
    r = subprocess.run([sys.executable, "-m", "fastxfer.cli", "bench", "timeline", str(path), "--step", "1", "--png",
                        str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"step 1: " in r.stdout and f"{n_vars} tensors in " in r.stdout, r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_op_library_loads_in_a_fresh_process():
    code = ("import warnings; warnings.simplefilter('error');"
            "import fastxfer.tensorflow.native as n; lib = n.library();"
            "assert lib is not None, n.reason();"
            "print(sorted(x for x in dir(lib) if x.startswith('fastxfer') and not x.endswith('_fallback')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=None)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "['fastxfer_submit', 'fastxfer_wait', 'fastxfer_wait_gather']" in r.stdout
