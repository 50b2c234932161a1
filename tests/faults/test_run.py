"""The `fastxfer run` launcher when ranks fail: exit codes, stopping the rest, naming the culprit,
and sweeping the shared-memory segments of launchers that died."""

import os
import subprocess
import sys
import tempfile
import time

import pytest

from _launch import fastxfer_cmd, launch, run_command

RANK = "import os; r = int(os.environ['FASTXFER_RANK'])"


def test_failing_rank_stops_the_rest_and_is_named():
    t0 = time.monotonic()
    r = launch(3, "-c", RANK + "; import sys, time\nif r == 1: sys.exit(7)\ntime.sleep(120)",
               launcher_args=["--grace", "1"], timeout=120)
    took = time.monotonic() - t0
    assert took < 60
    assert r.returncode == 7
    assert "rank 1 failed first (exit code 7)" in r.stderr
    assert "rank 0: killed by SIGTERM" in r.stderr and "rank 2: killed by SIGTERM" in r.stderr


def test_signal_death_exit_code():
    r = launch(2, "-c", RANK + "; import signal\nif r == 0: os.kill(os.getpid(), signal.SIGKILL)", timeout=120)
    assert r.returncode == 128 + 9
    assert "rank 0 failed first (killed by SIGKILL)" in r.stderr


def test_stale_segments_of_dead_launchers_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    stale = f"/dev/shm/fastxfer-{dead.pid}-{'ab' * 16}"
    live = f"/dev/shm/fastxfer-{os.getpid()}-{'cd' * 16}"  # a launcher that is still running: ours
    for p in (stale, live):
        with open(p, "wb") as f:
            f.write(b"\xff" * 4096)  # garbage: must never be mistaken for a job's segment
    try:
        r = launch(2, "-c", "import fastxfer as fx, numpy as np; fx.init(); "
                            "assert fx.allreduce(np.ones(4), op='sum').tolist() == [2.0] * 4; fx.shutdown()",
                   timeout=120)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        for p in (stale, live):
            if os.path.exists(p):
                os.unlink(p)


def test_stall_report_folders_of_dead_launchers_are_swept():
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    stale = os.path.join(tempfile.gettempdir(), f"fastxfer-report-{dead.pid}-x1")
    live = os.path.join(tempfile.gettempdir(), f"fastxfer-report-{os.getpid()}-x2")
    for p in (stale, live):
        os.makedirs(p, exist_ok=True)
        with open(os.path.join(p, "stall.0"), "w") as f:
            f.write("1\nold\n")
    try:
        r = launch(1, "-c", "print('hi')", timeout=120)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        import shutil

        for p in (stale, live):
            shutil.rmtree(p, ignore_errors=True)


@pytest.mark.parametrize("args,env,message", [
    (["--grace", "nan"], {}, "--grace must be a number of seconds >= 0, not nan"),
    (["--grace", "inf"], {}, "--grace must be a number of seconds >= 0, not inf"),
    (["--elastic-timeout", "0"], {}, "FASTXFER_ELASTIC_TIMEOUT='0.0': expected a number > 0"),
    (["--stall-check-warning-time-seconds", "nan"], {}, "FASTXFER_STALL_WARNING_S='nan': expected a number > 0"),
    (["--stall-check-shutdown-time-seconds", "nan"], {}, "FASTXFER_TIMEOUT='nan': expected a number > 0"),
    (["--start-timeout", "-1"], {}, "FASTXFER_ATTACH_TIMEOUT='-1.0': expected a number > 0"),
    ([], {"FASTXFER_TIMEOUT": "nan"}, "FASTXFER_TIMEOUT='nan': expected a number > 0"),
    ([], {"FASTXFER_STALL_WARNING_S": "nan"}, "FASTXFER_STALL_WARNING_S='nan': expected a number > 0"),
    ([], {"FASTXFER_ELASTIC_TIMEOUT": "-1"}, "FASTXFER_ELASTIC_TIMEOUT='-1': expected a number > 0"),
    ([], {"FASTXFER_GRACE": "nan"}, "FASTXFER_GRACE='nan': expected a number >= 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_timeouts_that_would_switch_fault_detection_off_are_refused_before_any_worker_starts(args, env, message,
                                                                                            tmp_path):
    """Issue 34 row 10: a NaN timeout silently turned stall detection off; 0 or -1 for the elastic
    timeout killed every survivor at once. The launcher refuses them up front, starting no worker."""
    marker = tmp_path / "started"
    r = run_command(fastxfer_cmd() + ["run", "-np", "2", *args, "--", sys.executable, "-c",
                                      f"open({str(marker)!r}, 'w').close()"], env={**os.environ, **env}, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert not marker.exists(), "a worker started"


def test_more_workers_than_the_open_files_limit_allows_are_refused_up_front(tmp_path):
    """Issue 34 row 12: -np 100000 under a limit gave "can't start new thread" and leaked the report
    folder. Under `ulimit -n 100`, -np 100 is refused before any worker starts, naming the limit."""
    marker = tmp_path / "started"
    before = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("fastxfer-report-")}
    r = run_command(["prlimit", "--nofile=100:100", "--"] + fastxfer_cmd() +
                    ["run", "-np", "100", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                    timeout=120)
    assert r.returncode != 0 and "-np 100 needs about 264 open files" in r.stderr and "ulimit -n" in r.stderr, \
        r.stderr
    assert not marker.exists()
    after = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("fastxfer-report-")}
    assert after <= before, "a report folder was left behind"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_more_workers_than_the_users_process_limit_allows_are_refused_up_front():
    """The same under `ulimit -u` as an ordinary user (the kernel exempts root from it)."""
    from fastxfer.launch import limits

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            os.setgid(65534)
            os.setuid(65534)
            import resource

            resource.setrlimit(resource.RLIMIT_NPROC, (limits._tasks_of_user(65534) + 200,) * 2)
            msg = ""
            try:
                limits.check(10)
                msg = "10 accepted"
                limits.check(100)
                msg = "100 accepted"
            except SystemExit as e:
                msg = f"{msg}; refused: {e}"
            os.write(wfd, msg.encode())
        finally:
            os._exit(0)
    os.close(wfd)
    os.waitpid(pid, 0)
    with os.fdopen(rfd) as f:
        got = f.read()
    assert got.startswith("10 accepted; refused: fastxfer run: -np 100 needs at least 500 processes and threads") \
        and "the process limit of this user (ulimit -u:" in got, got


ROW5 = """
import os, sys, time, numpy as np, fastxfer as fx
fx.init()
r = fx.rank()
fx.allreduce(np.ones(3, np.float32))
if r == 1:
    raise RuntimeError("rank 1 gives up")
time.sleep(60)  # computing outside fastxfer
fx.allreduce(np.ones(3, np.float32))
"""


def test_a_rank_that_raises_leaves_at_once_instead_of_waiting_for_its_peers_at_exit():
    """Issue 34 row 5: rank 1 raised while rank 0 computed outside fastxfer; rank 1 then waited in the
    exit-time collective shutdown until rank 0 called in (up to FASTXFER_TIMEOUT). Now it leaves at
    once and the job ends within the grace period."""
    t0 = time.monotonic()
    r = launch(2, "-c", ROW5, launcher_args=["--grace", "2"], env={"FASTXFER_TIMEOUT": "300"}, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1 and "RuntimeError: rank 1 gives up" in r.stderr
    assert "rank 1 failed first (exit code 1); rank 0: killed by SIGTERM" in r.stderr, r.stderr[-2000:]
    assert took < 30, took  # not the 60 s rank 0 computes, nor FASTXFER_TIMEOUT


ROW6 = """
import time, numpy as np, fastxfer as fx
fx.init()
r = fx.rank()
ps = fx.add_process_set([1, 2])
if r == 1:
    time.sleep(1000)  # stalls: the set's collective never comes
if r == 2:
    fx.allreduce(np.ones(3, np.float32), process_set=ps, name="x")
time.sleep(60)  # rank 0 computes; rank 2 fails first, in the set
"""


def test_the_launcher_names_the_rank_that_stalled_inside_a_process_set():
    """Issue 34 row 6: the stall was in set [1, 2] (rank 1 asleep); rank 2's exception named rank 1,
    then its exit-time shutdown waited for rank 0 and overwrote the report, so the launcher said
    "rank 0 stalled"."""
    r = launch(3, "-c", ROW6, launcher_args=["--grace", "2"], env={"FASTXFER_TIMEOUT": "6"}, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fastxfer run: job failed: rank 1 stalled (named by rank 2: rank 1 stalled: rank 2 waited"), \
        r.stderr[-3000:]


ROW7 = """
import time, numpy as np, fastxfer as fx
fx.init()
r = fx.rank()
fx.allreduce(np.ones(3, np.float32))
if r == 1:
    raise SystemExit(0)  # done early: exits cleanly while the others go on
for i in range(5):
    fx.allreduce(np.ones(3, np.float32))
    time.sleep(0.2)
"""


def test_a_rank_that_finishes_early_is_named_and_its_peers_get_a_peer_failure():
    """Issue 34 row 7: rank 1 exited 0 while the others still ran collectives; they failed in 0.2 s
    with a MismatchError, and the launcher said "rank 0 failed first"."""
    r = launch(3, "-c", ROW7, launcher_args=["--grace", "2"], timeout=120)
    assert r.returncode == 1
    assert "PeerFailureError: rank 1 finished (its script ended, or it called shutdown()) while rank 0 still " \
           "submitted allreduce" in r.stderr, r.stderr[-3000:]
    assert "MismatchError" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fastxfer run: job failed: rank 1 finished while the others still ran collectives "
                           "(named by rank "), last
    assert "rank 1: exit code 0" in last, last
