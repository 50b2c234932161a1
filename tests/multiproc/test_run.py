"""The `fastxfer run` launcher: rank-prefixed output and each rank's environment."""

from _launch import launch

RANK = "import os; r = int(os.environ['FASTXFER_RANK'])"


def test_rank_prefixed_output_and_environment():
    r = launch(3, "-c", RANK + "; import sys; print('out', r, os.environ['FASTXFER_SIZE']); "
                              "print('err', r, file=sys.stderr)", timeout=120)
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"[{k}] out {k} 3" in r.stdout.splitlines()
        assert f"[{k}] err {k}" in r.stderr.splitlines()
