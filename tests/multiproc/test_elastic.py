"""Elastic jobs through the real launcher (`fastxfer run --min-np`), engine and TensorFlow/Keras:
a worker killed with SIGKILL mid-epoch, during a commit, as rank 0, twice in a row, restarted;
weights against a plain job that runs the same steps from the same commit."""

import importlib.util
import os
import re
import signal
import time

import numpy as np
import pytest

from _launch import fastxfer_cmd, finish, launch, launch_cmd, launch_env, private_shm, run_command, start

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="TensorFlow not installed")
TF_KERAS = pytest.param(
    "tf-keras", marks=pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf-keras not installed"))
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "FASTXFER_SHM_WINDOW_MB": "1"}


def elastic(np_, min_np, *more):
    return ["--min-np", str(min_np), *more]


def lines(r, tag):
    """{worker: rest of line} for every `tag` line, by the launcher's worker prefix."""
    return {int(w): rest for w, rest in re.findall(rf"^\[\s*(\d+)\] {tag} (.*)$", r.stdout, re.M)}


@pytest.fixture(name="private_shm")
def _private_shm():
    """(env, folder): segments of the test's jobs in a folder of their own (_launch.private_shm)."""
    with private_shm() as found:
        yield found


@pytest.fixture(scope="module")
def small_pack(make_jpeg, tmp_path_factory):
    """96 small JPEGs in 4 classes, packed."""
    from fastxfer.data.writer import pack

    d = tmp_path_factory.mktemp("elastic-pack")
    items = []
    for i in range(96):
        p = d / f"{i}.jpg"
        p.write_bytes(make_jpeg(16, 16, seed=i, content="photo"))
        items.append((str(p), i % 4))
    out = str(d / "small.fxp")
    pack(items, out, progress=False, threads=1)
    return out


def ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


# -- framework-free ------------------------------------------------------------------------------------
def test_killed_worker_the_survivors_go_on_and_old_requests_fail(private_shm):
    shm_env, shm = private_shm
    r = launch(3, "elastic_np_worker.py", 12, "2@5", launcher_args=elastic(3, 2), env={**ENV, **shm_env})
    ok(r)
    done = lines(r, "DONE")
    assert sorted(done) == [0, 1], r.stdout
    # steps 0-4 with 3 ranks, then 5-11 with 2: the restored commit is exactly the last good step
    total = sum(3 * s for s in range(5)) + sum(2 * s for s in range(5, 12))
    for w in (0, 1):
        assert done[w] == f"rank {w} size 2 steps 12 total {total}", done
    assert r.stdout.count("old handle failed: PeerFailureError") == 2, r.stdout
    assert "generation 1: 2 worker(s) (workers 0, 1 as ranks 0..1)" in r.stderr
    assert re.search(r"elastic job finished with 2 worker\(s\) \(generation 1\); recovered from 1 failure\(s\): "
                     r"worker 2 \(rank 2 of generation 0\): killed by SIGKILL", r.stderr), r.stderr
    assert os.listdir(shm) == []  # no segment left behind


def test_a_worker_that_finishes_early_is_a_departure_and_the_others_go_on():
    """Issue 34 row 7: a worker that exits cleanly while the others still train used to surface as a
    MismatchError that killed the job; it is a departure: the survivors re-form and finish."""
    r = launch(3, "elastic_departure_worker.py", launcher_args=elastic(3, 2), env=ENV)
    ok(r)
    assert "worker 2 leaves cleanly" in r.stdout
    assert "generation 1: 2 worker(s) (workers 0, 1 as ranks 0..1)" in r.stderr, r.stderr
    assert "[0] step 8 size 2" in r.stdout and "MismatchError" not in r.stdout + r.stderr
    assert sorted(ln.split("] ", 1)[1] for ln in r.stdout.splitlines() if "DONE" in ln) == \
        ["DONE rank 0 steps 8", "DONE rank 1 steps 8"], r.stdout


def test_a_member_that_dies_before_it_attaches_the_others_re_form_at_once(tmp_path):
    """Issue 34 row 3: survivors waited the whole attach timeout (120 s) for a member killed after it
    joined and before it attached, then failed the first generation although --min-np survived."""
    r = launch(3, "elastic_attach_worker.py", str(tmp_path / "flag"), launcher_args=elastic(3, 2),
               env={**ENV, "FASTXFER_ATTACH_TIMEOUT": "120"})
    ok(r)
    assert r.stderr.count("died before it attached to the job's shared memory") == 2, r.stderr
    took = [float(x) for x in re.findall(r"init took ([\d.]+) s, size 2", r.stdout)]
    assert len(took) == 2 and max(took) < 20, r.stdout  # seconds, not the 120 s attach timeout
    assert sorted(ln.split("] ", 1)[1] for ln in r.stdout.splitlines() if "DONE" in ln) == \
        ["DONE rank 0 size 2 steps 3", "DONE rank 1 size 2 steps 3"], r.stdout


def _done(r):
    return sorted(ln.split("] ", 1)[1] for ln in r.stdout.splitlines() if "DONE" in ln)


def test_a_worker_stopped_before_its_first_init_is_killed_and_the_others_start():
    """Issue 34 row 13: the first generation waited for ever, in silence, for a SIGSTOPped worker."""
    t0 = time.monotonic()
    r = launch(3, "elastic_stop_worker.py", "stop_before_init", launcher_args=elastic(3, 2),
               env={**ENV, "FASTXFER_ATTACH_TIMEOUT": "300"})
    ok(r)
    assert "worker 2 is stopped (SIGSTOP) and cannot rejoin: killing it" in r.stderr, r.stderr
    assert _done(r) == ["DONE steps 10 size 2"] * 2, r.stdout
    assert time.monotonic() - t0 < 120


def test_a_worker_stopped_in_training_is_a_failure_within_seconds_and_the_resume_time_is_true():
    """Issue 34 row 13: a SIGSTOPped worker cost FASTXFER_TIMEOUT + FASTXFER_ELASTIC_TIMEOUT (600 s
    by default) and the summary said "resumed 0.0 s after"."""
    r = launch(3, "elastic_stop_worker.py", "stop_in_training", launcher_args=elastic(3, 2), env=ENV)
    ok(r)
    assert "worker 2 is stopped (SIGSTOP) and cannot rejoin: killing it" in r.stderr, r.stderr
    assert _done(r) == ["DONE steps 10 size 2"] * 2, r.stdout
    m = re.search(r"training resumed ([\d.]+) s after the last commit before them", r.stderr)
    assert m and 4.0 <= float(m[1]) < 60, r.stderr  # the 5 s a stopped peer is given, not 0.0, not 600


def test_a_restarted_worker_that_dies_before_joining_is_replaced_while_restarts_remain():
    r = launch(3, "elastic_stop_worker.py", "restart_dies", launcher_args=elastic(3, 2, "--max-restarts", "2"),
               env=ENV)
    ok(r)
    assert "worker 3 failed before joining the group (exit code 3)" in r.stderr
    assert "starting worker 4 in its place (0 restart(s) left)" in r.stderr, r.stderr
    assert _done(r) == ["DONE steps 10 size 3"] * 3, r.stdout


def test_rank_0_killed_rank_1_becomes_rank_0():
    r = launch(3, "elastic_np_worker.py", 8, "0@3", launcher_args=elastic(3, 2), env=ENV)
    ok(r)
    done = lines(r, "DONE")
    total = sum(3 * s for s in range(3)) + sum(2 * s for s in range(3, 8))
    assert done == {1: f"rank 0 size 2 steps 8 total {total}", 2: f"rank 1 size 2 steps 8 total {total}"}, r.stdout


def test_fewer_than_min_np_ends_the_job_naming_every_failure():
    r = launch(3, "elastic_np_worker.py", 12, "2@3", "1@5", launcher_args=elastic(3, 2), env=ENV)
    assert r.returncode == 137, r.stderr  # the first failure's SIGKILL
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fastxfer run: elastic job failed: 1 worker(s) left, fewer than --min-np 2"), last
    assert "worker 2 (rank 2 of generation 0): killed by SIGKILL" in last
    assert "worker 1 (rank 1 of generation 1): killed by SIGKILL" in last


def test_restarted_worker_joins_at_the_next_commit():
    r = launch(3, "elastic_np_worker.py", 40, "2@5", launcher_args=elastic(3, 2, "--max-restarts", "1"),
               env={**ENV, "NAP": "0.1"})
    ok(r)
    done = lines(r, "DONE")
    assert sorted(done) == [0, 1, 3], r.stdout  # worker 3 replaced worker 2
    assert "starting worker 3 in its place (0 restart(s) left)" in r.stderr
    assert "generation 2: 3 worker(s) (workers 0, 1, 3 as ranks 0..2)" in r.stderr, r.stderr
    totals = {d.split(" total ")[1] for d in done.values()}
    assert len(totals) == 1 and all(" size 3 steps 40 " in d for d in done.values()), done


def test_without_an_elastic_launcher_a_failure_still_ends_the_job():
    # the same script under a plain `fastxfer run`: elastic.run calls the function once and the
    # survivor's PeerFailureError ends the job as usual
    r = launch(2, "elastic_np_worker.py", 12, "1@5", env=ENV)
    assert r.returncode == 137, r.stderr
    assert "PeerFailureError" in r.stderr and "job failed: rank 1 failed first (killed by SIGKILL)" in r.stderr


def test_restarted_worker_that_comes_too_late_is_stopped_and_the_job_succeeds():
    # the restarted worker (worker 3) waits 60 s before it joins: the survivors finish long before; it is stopped
    r = launch(3, "elastic_np_worker.py", 30, "2@3", launcher_args=elastic(3, 2, "--max-restarts", "1"),
               env={**ENV, "LATE": "3:60"})
    ok(r)
    assert sorted(lines(r, "DONE")) == [0, 1], r.stdout
    assert "elastic job finished with 2 worker(s) (generation 1)" in r.stderr


def test_sigterm_to_an_elastic_launcher_stops_every_worker_and_the_rendezvous(private_shm):
    shm_env, shm = private_shm
    p = start(launch_cmd(3, "elastic_np_worker.py", 100000, launcher_args=elastic(3, 2)),
              env=launch_env({**ENV, **shm_env, "NAP": "0.05"}))
    time.sleep(4)  # the workers start and train (a step per 50 ms); stopped wherever they are
    os.kill(p.pid, signal.SIGTERM)
    r = finish(p, timeout=120)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fastxfer run: job stopped: the launcher asked to stop (SIGTERM); all workers stopped "
                           "(worker 0: "), last
    assert "fastxfer run: the launcher asked to stop (SIGTERM): sending SIGTERM to every worker" in r.stderr
    assert "generation 1" not in r.stderr  # stopping is not a failure: no re-forming
    assert os.listdir(shm) == []


def test_usage_errors():
    r = run_command(fastxfer_cmd() + ["run", "-np", "2", "--min-np", "1", "--hosts", "a:1,b:1", "--", "true"])
    assert r.returncode != 0 and "elastic jobs (--min-np/--max-np/--max-restarts) run on one host for now" in r.stderr
    r = run_command(fastxfer_cmd() + ["run", "-np", "2", "--min-np", "3", "--", "true"])
    assert r.returncode != 0 and "need 1 <= --min-np (3) <= -np (2) <= --max-np (2)" in r.stderr


# -- TensorFlow and Keras -------------------------------------------------------------------------------
def _final_weights_match_reference(tmp_path, small_pack, generation, size):
    """A plain job of `size` workers from resume_g<generation>.npz, the same steps: the same weights."""
    resume = np.load(tmp_path / f"resume_g{generation}.npz")
    assert int(resume["size"]) == size
    r = launch(size, "elastic_worker.py", "reference", tmp_path,
               env={**ENV, "PACK": small_pack, "RESUME": str(tmp_path / f"resume_g{generation}.npz")}, timeout=600)
    ok(r)
    a, b = np.load(tmp_path / "final.npz"), np.load(tmp_path / "final_ref.npz")
    assert a.files == b.files
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=k)
    return resume


@needs_tf
def test_tf_loop_killed_mid_epoch_matches_a_plain_job_from_the_same_commit(tmp_path, small_pack, private_shm):
    shm_env, shm = private_shm
    env = {**ENV, **shm_env, "PACK": small_pack, "KILLS": "2@step5"}
    r = launch(3, "elastic_worker.py", "loop", tmp_path, launcher_args=elastic(3, 2), env=env, timeout=600)
    ok(r)
    final = lines(r, "FINAL")
    assert sorted(final) == [0, 1], r.stdout
    assert len({f.split("digest ")[1] for f in final.values()}) == 1 and all("size 2 generation 1 epoch 2" in f
                                                                             for f in final.values()), final
    resume = _final_weights_match_reference(tmp_path, small_pack, 1, 2)
    # restored to the commit after step 5: 5 steps of 3 ranks x 4 records done in epoch 0
    assert int(resume["steps"]) == 5 and int(resume["start"]) == 5 * 3 * 4 and int(resume["epoch"]) == 0
    assert os.listdir(shm) == []


@needs_tf
def test_tf_loop_restarted_worker_joins_and_the_job_finishes_with_3(tmp_path, small_pack):
    env = {**ENV, "PACK": small_pack, "KILLS": "2@step5", "HOLD_FOR_NEWCOMER": "1"}
    r = launch(3, "elastic_worker.py", "loop", tmp_path, launcher_args=elastic(3, 2, "--max-restarts", "1"), env=env,
               timeout=600)
    ok(r)
    final = lines(r, "FINAL")
    assert sorted(final) == [0, 1, 3], r.stdout  # worker 3 took worker 2's place
    assert len({f.split("digest ")[1] for f in final.values()}) == 1, final
    assert all("size 3 generation 2 epoch 2" in f for f in final.values()), final
    assert "generation 2: 3 worker(s) (workers 0, 1, 3 as ranks 0..2)" in r.stderr, r.stderr
    resume = _final_weights_match_reference(tmp_path, small_pack, 2, 3)
    # it joined at the first commit of generation 1: one step of 2 ranks after the restored step 5
    assert int(resume["steps"]) == 6 and int(resume["start"]) == 5 * 3 * 4 + 2 * 4


@needs_tf
@pytest.mark.parametrize("flavour", ["keras3", TF_KERAS])
def test_keras_fit_survives_a_failed_commit_rank_0_and_two_failures_in_a_row(flavour, tmp_path):
    # worker 0 (rank 0) dies inside the commit before batch 3; worker 2 after batch 7; worker 1 in the
    # reset that follows (a second failure while the group re-forms). 5 workers -> 2.
    env = {**ENV, "KILLS": "0@commit3,2@step7,1@reset2"}
    if flavour == "tf-keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    r = launch(5, "elastic_worker.py", "keras", tmp_path, launcher_args=elastic(5, 2), env=env, timeout=600)
    ok(r)
    final = lines(r, "FINAL")
    assert sorted(final) == [3, 4], r.stdout
    assert len({f.split("digest ")[1] for f in final.values()}) == 1, final  # identical weights and slots
    assert all("size 2 generation 3 epoch 3" in f for f in final.values()), final
    for w in (3, 4):  # every epoch trained steps_per_epoch batches in all, across the resets
        epochs = re.findall(rf"^\[{w}\] EPOCH (\d+) size \d+ first (\d+) trained (\d+)$", r.stdout, re.M)
        assert [int(e) for e, _, _ in epochs] == [1, 2, 3], r.stdout
        assert all(int(f) + int(t) == 6 for _, f, t in epochs), epochs
    assert "ran out of data" not in r.stdout + r.stderr
    assert r.stderr.count("killed by SIGKILL") >= 3


@needs_tf
@pytest.mark.parametrize("flavour", [TF_KERAS])  # the example's optimizer.lr is Keras 2's
def test_horovod_elastic_keras_example_runs_with_only_the_import_changed(flavour, tmp_path):
    env = {**ENV, "TF_USE_LEGACY_KERAS": "1", "KILL_WORKER": "2", "KILL_AFTER": "5"}
    r = launch(3, os.path.join("horovod_examples", "tensorflow2_keras_mnist_elastic.py"), launcher_args=elastic(3, 2),
               env=env, timeout=600, cwd=tmp_path)
    ok(r)
    final = lines(r, "FINAL")
    assert sorted(final) == [0, 1], r.stdout
    # the same weights on both survivors; the reset callback rescaled the learning rate to 1.0 x 2
    assert len({f.split(" weights ")[1] for f in final.values()}) == 1, final
    assert all(f.startswith(f"rank {w} size 2 epoch 4 lr 2.0 ") for w, f in final.items()), final
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.h5")) == [f"checkpoint-{e}.h5" for e in (1, 2, 3, 4)]
