"""Loading fastxfer's native TensorFlow ops: a library that cannot load falls back to the
tf.numpy_function bridge with exactly one warning that says why; FASTXFER_TF_NATIVE=0 chooses
the bridge silently; results are the same either way. Each case runs in a fresh process; the four
processes run side by side (each is mostly TensorFlow's start-up, on one core)."""

import importlib.util
import json
import os
import sys

import pytest

from _launch import finish, start

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")

PROGRAM = r"""
import json, sys, warnings
import numpy as np
import tensorflow as tf
import fastxfer as fx, fastxfer.tensorflow as hvd
from fastxfer.tensorflow import native
if sys.argv[1] != "-":
    native.PATH = sys.argv[1]
fx.init()
import logging
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("fastxfer").addHandler(Keep(logging.WARNING))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = tf.constant(np.arange(6, dtype=np.float32))
    a = hvd.allreduce(x, op="sum").numpy()
    b = tf.function(lambda t: hvd.allreduce(t, op="average", compression="bf16"))(x).numpy()
    c = hvd.allgather(tf.constant([[1, 2]], tf.int64)).numpy()
print(json.dumps({"native": native.library() is not None, "reason": native.reason(),
                  "warnings": said + [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                  "a": a.tolist(), "b": b.tolist(), "c": c.tolist()}))
fx.shutdown()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """case -> (library path given, the program's result), all four processes started together."""
    d = tmp_path_factory.mktemp("tfops")
    (d / "corrupt").mkdir()
    corrupt = d / "corrupt" / "_tfops.so"
    corrupt.write_bytes(b"\x7fELF not really a shared library")
    cases = {"default": ("-", {}), "missing": (str(d / "missing" / "_tfops.so"), {}), "corrupt": (str(corrupt), {}),
             "bridge": ("-", {"FASTXFER_TF_NATIVE": "0"})}
    procs = {k: start([sys.executable, "-c", PROGRAM, path], env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env})
             for k, (path, env) in cases.items()}
    done = {k: finish(p, timeout=600) for k, p in procs.items()}
    return {k: (cases[k][0], done[k]) for k in cases}


def _result(runs, case):
    path, r = runs[case]
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["a"] == list(range(6)) and got["b"] == list(range(6)) and got["c"] == [[1, 2]]
    return path, got


def test_native_library_is_used_by_default(runs):
    _, got = _result(runs, "default")
    assert got["native"] and got["reason"] is None and got["warnings"] == []


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_unloadable_library_falls_back_with_one_warning(runs, kind):
    lib, got = _result(runs, kind)
    assert not got["native"]
    assert len(got["warnings"]) == 1, got["warnings"]  # three collectives, one warning
    w = got["warnings"][0]
    assert "could not be loaded" in w and "numpy_function" in w
    assert (lib + " is missing" if kind == "missing" else lib) in w


def test_bridge_chosen_on_purpose_is_silent(runs):
    _, got = _result(runs, "bridge")
    assert not got["native"] and got["reason"] == "FASTXFER_TF_NATIVE=0" and got["warnings"] == []
