"""Horovod's optimizer and tape options on 2 ranks, exact values (tests/workers/tape_options_worker.py):
explicit fusion groups (groups=, num_groups=) really decide the buckets -- read from the job's
timeline --, backward_passes_per_step with sparse_as_dense and mixed precision, SyncBatchNormalization
inside model.fit, and local variables; Keras 3 and tf-keras."""

import json
import re

import pytest

from _launch import TAPE_KERAS_MODES as KERAS_MODES, TF_KERAS_SCRIPTS, assert_ok, launch, script_output

W = "tape_options_worker.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.fixture(scope="module")
def keras3_job(tmp_path_factory):
    path = tmp_path_factory.mktemp("timeline") / "tl.json"
    result = launch(2, W, "tape_groups," + KERAS_MODES, env={**ENV, "FASTXFER_TIMELINE": str(path)}, timeout=600)
    return result, path


def _buckets(path, rank):
    """{bucket label: set of tensor names} of one rank's allreduces on the timeline."""
    events = [e for e in json.loads(path.read_text()) if e["pid"] == rank]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    out = {}
    for e in events:
        if e["ph"] == "X" and e["name"] == "allreduce":
            out.setdefault(e["args"]["bucket"], set()).add(lanes[e["tid"]])
    return out


def _by_variable(buckets, prefix):
    """The buckets holding the variables named prefix0..3, as sorted tuples of variable names."""
    found = []
    for names in buckets.values():
        mine = {re.search(rf"\.({prefix}\d)$", n).group(1) for n in names if re.search(rf"\.{prefix}\d$", n)}
        if mine:
            assert len(mine) == len(names), names  # no other tensor shares a group's bucket
            found.append(tuple(sorted(mine)))
    return sorted(found)


def test_tape_groups_and_grouped_allreduce_lists_are_the_fused_buckets_on_the_timeline(keras3_job):
    result, path = keras3_job
    assert_ok(result, 2, "tape_groups")
    for rank in (0, 1):
        buckets = _buckets(path, rank)
        # num_groups=2 cuts [ga0..ga3] into two consecutive halves; each step (2 of them) its own buckets
        assert _by_variable(buckets, "ga") == [("ga0", "ga1")] * 2 + [("ga2", "ga3")] * 2
        # groups=[[gb0, gb2], [gb1]]: gb3, in no list, alone (traced, 2 steps)
        assert _by_variable(buckets, "gb") == [("gb0", "gb2")] * 2 + [("gb1",)] * 2 + [("gb3",)] * 2
        # without groups the four small gradients are one held run: one bucket per step
        assert _by_variable(buckets, "gc") == [("gc0", "gc1", "gc2", "gc3")] * 2
        # grouped_allreduce: each call's list is a group of its own
        assert _by_variable(buckets, "gd") == [("gd0", "gd1")] * 2 + [("gd2", "gd3")] * 2


def test_grouped_optimizer_buckets_hold_one_group_each(keras3_job):
    result, path = keras3_job
    assert_ok(result, 2, "optimizer_groups keras3")
    for rank in (0, 1):
        grouped = 0
        for names in _buckets(path, rank).values():
            groups = {re.match(r"DistributedOptimizer\.(g\d+)\.", n) and re.match(r"DistributedOptimizer\.(g\d+)\.",
                                                                                   n).group(1) for n in names}
            if any(n.startswith("DistributedOptimizer.g") for n in names):
                grouped += 1
                assert len(groups) == 1 and None not in groups, names  # one group per bucket, nothing else
        # og model: {og1 kernel, og2 kernel}, {og1 bias}; the num_groups=2 model: its two kernels apart
        assert grouped == 4


@pytest.mark.parametrize("mode", ["bpps", "syncbn", "local_vars"])
def test_keras3_options_exact(keras3_job, mode):
    assert_ok(keras3_job[0], 2, f"{mode} keras3")


@pytest.fixture(scope="module")
def tf_keras_job(request):
    """The modes on tf-keras: their part of the shared 2-rank tf-keras job (conftest.py)."""
    pytest.importorskip("tf_keras")
    assert TF_KERAS_SCRIPTS["tape_options"] == (f"tests/workers/{W}", [KERAS_MODES])
    return script_output(request.getfixturevalue("tf_keras_scripts_job")[0], "tape_options")


@pytest.mark.parametrize("mode", KERAS_MODES.split(","))
def test_tf_keras_options_exact(tf_keras_job, mode):
    assert_ok(tf_keras_job, 2, f"{mode} tf-keras")


def test_three_ranks_groups_buckets_and_local_gradients(tmp_path):
    path = tmp_path / "tl.json"
    r = launch(3, W, "tape_groups,local_vars", env={**ENV, "FASTXFER_TIMELINE": str(path)}, timeout=600)
    assert_ok(r, 3, "tape_groups")
    assert_ok(r, 3, "local_vars keras3")
    for rank in (0, 1, 2):
        buckets = _buckets(path, rank)
        assert _by_variable(buckets, "ga") == [("ga0", "ga1")] * 2 + [("ga2", "ga3")] * 2
        assert _by_variable(buckets, "gb") == [("gb0", "gb2")] * 2 + [("gb1",)] * 2 + [("gb3",)] * 2
        assert _by_variable(buckets, "gd") == [("gd0", "gd1")] * 2 + [("gd2", "gd3")] * 2
