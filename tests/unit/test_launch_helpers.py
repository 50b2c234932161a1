"""The shared test helpers in tests/_launch.py: the per-rank OK-line check fails on a missing,
repeated or foreign rank, and a command past its timeout fails the test and is stopped."""

import subprocess
import sys
import time

import pytest

from _launch import assert_ok, launch_cmd, ok_lines, run_command


def job(stdout, rc=0):
    return subprocess.CompletedProcess(["fake"], rc, stdout, "")


def test_ok_lines_from_the_launcher_and_from_mpirun():
    launcher = "[0] OK sweep 10 cases on rank 0\n[1] OK sweep 10 cases on rank 1\n[1] OK sweeping\n"
    assert [k for k, _ in ok_lines(launcher, "sweep")] == [0, 1]
    assert [k for k, _ in ok_lines("OK tape bf16 rank 1 err 0\nOK tape bf16 rank 0 err 0\n", "tape bf16")] == [1, 0]
    assert ok_lines("[ 3] OK fit graph rank 3\n", "fit graph") == [(3, "[ 3] OK fit graph rank 3")]
    assert ok_lines("[0] not OK sweep\n", "sweep") == []


def test_assert_ok_wants_exactly_one_line_per_rank():
    assert assert_ok(job("[1] OK x rank 1\n[0] OK x rank 0\n"), 2, "x") == ["[0] OK x rank 0", "[1] OK x rank 1"]
    for bad in [job("[0] OK x\n"), job("[0] OK x\n[0] OK x\n"), job("[0] OK x\n[2] OK x\n"), job("OK x\nOK x\n"),
                job("[0] OK x\n[1] OK x\n", rc=1)]:
        with pytest.raises(AssertionError):
            assert_ok(bad, 2, "x")


def test_a_command_past_its_timeout_fails_and_is_stopped():
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 1 s"):
        run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=1)
    assert time.monotonic() - t0 < 30


def test_launch_cmd_finds_the_workers():
    cmd = launch_cmd(2, "collectives_worker.py", "sweep", 3, launcher_args=["--grace", 1])
    assert cmd[-10:-3] == ["run", "-np", "2", "--grace", "1", "--", sys.executable]
    assert cmd[-3].endswith("/tests/workers/collectives_worker.py")
    assert cmd[-2:] == ["sweep", "3"] and launch_cmd(1, "-c", "pass")[-2:] == ["-c", "pass"]
