"""The MPI paths under bad input: ranks that disagree across emulated hosts, and hosts that run
different numbers of ranks."""

import re

import pytest

from _launch import mpi_launch, needs_mpi

pytestmark = needs_mpi
W = "collectives_worker.py"


@pytest.mark.parametrize("kind", ["name", "count", "oob", "shape", "dtype"])
def test_hierarchical_mismatch_on_every_rank(kind):
    r = mpi_launch(4, W, "mismatch", kind, per_host=2)
    lines = [ln for ln in r.stdout.splitlines() if re.match(r"MISMATCH rank \d: ", ln)]
    assert len(lines) == 4, r.stdout + r.stderr
    assert len({ln.split(": ", 1)[1] for ln in lines}) == 1  # the same message on every rank
    # a collective with different contents fails alone: the next one works on every host; different
    # names (sequences that differ) and the oob lane poison the group
    after = "RECOVERED rank" if kind in ("shape", "dtype") else "STILL-MISMATCH rank"
    assert r.stdout.count(after) == 4, r.stdout
    assert "NO ERROR" not in r.stdout


def test_uneven_hosts_are_refused():
    r = mpi_launch(3, W, "info", per_host=2)  # hosts h0 (ranks 0, 1) and h1 (rank 2)
    assert r.returncode != 0
    assert "hosts run different numbers of ranks (2, 1)" in r.stdout + r.stderr
