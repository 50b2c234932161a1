"""join(): ranks with uneven numbers of batches, through the real launcher and engine."""

import json
import re

import pytest

from _launch import launch, mpi_launch, needs_mpi

W = "join_worker.py"
STEPS = {2: [2, 4], 3: [3, 5, 1], 4: [3, 5, 1, 2]}


def _uneven(n, how):
    if how == "mpirun, 2 emulated hosts":
        return mpi_launch(n, W, "uneven", per_host=2)
    return launch(n, W, "uneven")


@pytest.mark.parametrize("n,how", [(2, "fastxfer run"), (3, "fastxfer run"),
                                   pytest.param(4, "mpirun, 2 emulated hosts", marks=needs_mpi)])
def test_joined_ranks_stand_in_with_neutral_elements(n, how):
    r = _uneven(n, how)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {}
    for line in r.stdout.splitlines():
        if "RESULT " in line:
            d = json.loads(line.split("RESULT ", 1)[1])
            got[d["rank"]] = d
    assert sorted(got) == list(range(n)), r.stdout
    steps = STEPS[n]
    last = max(range(n), key=lambda j: (steps[j], j))  # the rank with the most batches joins last
    for rank, d in got.items():
        assert d["last"] == last
        assert d["after"] == [float(n)] * 2
        assert len(d["steps"]) == steps[rank]
        for i, s in enumerate(d["steps"]):
            live = [j for j in range(n) if steps[j] > i]  # ranks that still have batch i
            assert s["sum"] == [float(sum(j + 1 for j in live))] * 5
            assert s["max_i64"] == [max(j + 1 for j in live), max(-j for j in live)]
            assert s["min_f64"] == [float(min(j + 1 for j in live))]
            # an average still divides by the whole job's size (joined ranks count as zeros)
            want = sum(j + 1 for j in live) / n
            assert all(abs(v - want) <= abs(want) * 2 ** -8 for v in s["avg_bf16"]), (s, want)


def test_other_collectives_while_a_rank_has_joined_are_a_mismatch():
    r = launch(2, W, "broadcast_while_joined")
    lines = sorted(ln for ln in r.stdout.splitlines() if "MISMATCH rank" in ln)
    assert len(lines) == 1 and lines[0].startswith("[1] "), r.stdout + r.stderr  # the joined rank is not involved
    assert "rank 1 submitted broadcast 'late' float32[3] root=1 but rank(s) 0 have joined" in lines[0], lines[0]
    # the broadcast failed alone: rank 1 joins too, rank 1 joined last, and the next allreduce works
    assert sorted(re.findall(r"JOINED rank (\d) last=(\d) after=\[(.*)\]", r.stdout)) == \
        [("0", "1", "3.0, 3.0"), ("1", "1", "3.0, 3.0")], r.stdout + r.stderr
    assert r.returncode == 0
