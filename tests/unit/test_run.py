"""The `fastxfer run` launcher's usage errors, caught before any rank starts."""

import os

from _launch import ROOT, fastxfer_cmd, run_command


def test_usage_errors(tmp_path):
    def run(*args, env=None):
        return run_command(fastxfer_cmd() + ["run", *args], timeout=60, env=env, cwd=ROOT)

    r = run("-np", "2")
    assert r.returncode != 0 and "no command given" in r.stderr
    r = run("-np", "0", "--", "true")
    assert r.returncode != 0 and "-np must be at least 1" in r.stderr
    r = run("-np", "2", "--bind", "core", "--", "true")
    assert r.returncode == 2 and "invalid choice: 'core'" in r.stderr
    # binding works from any working directory, this checkout included
    r = run("-np", "1", "--bind", "socket", "--", "true")
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no mpirun
    r = run("-np", "2", "--hosts", "a:1,b:1", "--", "true", env=env)
    assert r.returncode != 0 and "mpirun, which is not on PATH" in r.stderr
