"""The `fastxfer run` launcher: output, exit codes, stopping the rest, shared-memory hygiene."""

import os
import subprocess
import sys
import time

from _launch import fastxfer_cmd

RANK = "import os; r = int(os.environ['FASTXFER_RANK'])"


def run(np_, code, *launcher_args, timeout=120, env=None):
    cmd = fastxfer_cmd() + ["run", "-np", str(np_), *launcher_args, "--", sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")


def test_rank_prefixed_output_and_environment():
    r = run(3, RANK + "; import sys; print('out', r, os.environ['FASTXFER_SIZE']); print('err', r, file=sys.stderr)")
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"[{k}] out {k} 3" in r.stdout.splitlines()
        assert f"[{k}] err {k}" in r.stderr.splitlines()


def test_failing_rank_stops_the_rest_and_is_named():
    t0 = time.monotonic()
    r = run(3, RANK + "; import sys, time\nif r == 1: sys.exit(7)\ntime.sleep(120)", "--grace", "1")
    took = time.monotonic() - t0
    assert took < 60
    assert r.returncode == 7
    assert "rank 1 failed first (exit code 7)" in r.stderr
    assert "rank 0: killed by SIGTERM" in r.stderr and "rank 2: killed by SIGTERM" in r.stderr


def test_signal_death_exit_code():
    r = run(2, RANK + "; import signal\nif r == 0: os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == 128 + 9
    assert "rank 0 failed first (killed by SIGKILL)" in r.stderr


def test_stale_segments_of_dead_launchers_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/fastxfer-{dead.pid}-{'ab' * 16}"
    live = f"/dev/shm/fastxfer-{os.getpid()}-{'cd' * 16}"  # a launcher that is still running: ours
    for p in (stale, live):
        with open(p, "wb") as f:
            f.write(b"\xff" * 4096)  # garbage: must never be mistaken for a job's segment
    try:
        r = run(2, "import fastxfer as fx, numpy as np; fx.init(); "
                   "assert fx.allreduce(np.ones(4), op='sum').tolist() == [2.0] * 4; fx.shutdown()")
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        for p in (stale, live):
            if os.path.exists(p):
                os.unlink(p)


def test_usage_errors(tmp_path):
    r = subprocess.run(fastxfer_cmd() + ["run", "-np", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no command given" in r.stderr
    r = subprocess.run(fastxfer_cmd() + ["run", "-np", "0", "--", "true"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "-np must be at least 1" in r.stderr
    r = subprocess.run(fastxfer_cmd() + ["run", "-np", "2", "--bind", "core", "--", "true"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'core'" in r.stderr
    # binding works from any working directory, this checkout included
    r = subprocess.run(fastxfer_cmd() + ["run", "-np", "1", "--bind", "socket", "--", "true"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no mpirun
    r = subprocess.run(fastxfer_cmd() + ["run", "-np", "2", "--hosts", "a:1,b:1", "--", "true"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode != 0 and "mpirun, which is not on PATH" in r.stderr
