"""The MPI paths: jobs started by mpirun (ranks found through mpi4py), `fastxfer run --hosts`, and
the hierarchical transport across hosts — emulated on this machine by giving ranks different
host identities (FASTXFER_HOST_ID), oversubscribed on 2 cores."""

import pytest

from _launch import MPI_ENV, assert_ok, fastxfer_segments, launch, mpi_launch, needs_mpi

pytestmark = needs_mpi
W = "collectives_worker.py"


def test_mpirun_single_host_uses_shared_memory():
    r = mpi_launch(2, W, "info")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=0 size=2 local_rank=0 local_size=2" in r.stdout
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout
    assert_ok(mpi_launch(2, W, "sweep"), 2, "sweep")


def test_two_emulated_hosts_layout():
    r = mpi_launch(4, W, "info", per_host=2)
    assert r.returncode == 0, r.stdout + r.stderr
    for g, l in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"INFO rank={g} size=4 local_rank={l} local_size=2" in r.stdout


@pytest.mark.parametrize("mode", ["sweep", "compressed", "collectives", "dtypes15", "alltoall", "reducescatter"])
def test_hierarchical_results_exact(mode):
    before = fastxfer_segments()
    assert_ok(mpi_launch(4, W, mode, per_host=2), 4, mode)
    assert fastxfer_segments() == before


def test_16_bit_sums_across_three_hosts_round_once():
    """bf16/fp16 across 3 emulated hosts: bit-exact against the contract (each host's partial
    rounded for the wire, the partials added in float32 and rounded once), within a bound that does
    not grow with the number of hosts."""
    assert_ok(mpi_launch(6, W, "compressed", per_host=2), 6, "compressed")


def test_launcher_hands_off_to_mpirun():
    r = launch(2, W, "info", launcher_args=["--hosts", "localhost:2"], env=MPI_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout
