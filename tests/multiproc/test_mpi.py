"""The MPI paths: jobs started by mpirun (ranks found through mpi4py), `fastxfer run --hosts`, and
the hierarchical transport across hosts — emulated on this machine by giving ranks different
host identities (FASTXFER_HOST_ID), oversubscribed on 2 cores."""

import pytest

from _launch import MPI_ENV, assert_ok, fastxfer_segments, launch, mpi_launch, needs_mpi

pytestmark = needs_mpi
W = "collectives_worker.py"


def test_mpirun_single_host_uses_shared_memory():
    r = mpi_launch(2, W, "info,sweep")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=0 size=2 local_rank=0 local_size=2" in r.stdout
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout
    assert_ok(r, 2, "sweep")


HIERARCHICAL = ["sweep", "compressed", "collectives", "dtypes15", "alltoall", "reducescatter"]


@pytest.fixture(scope="module")
def two_emulated_hosts():
    """One mpirun job of 4 ranks on 2 emulated hosts for the tests below: the layout, then every
    HIERARCHICAL mode (mpirun starts once); (job, segments before, segments after)."""
    before = fastxfer_segments()
    r = mpi_launch(4, W, ",".join(["info", *HIERARCHICAL]), per_host=2)
    return r, before, fastxfer_segments()


def test_two_emulated_hosts_layout(two_emulated_hosts):
    r, _, _ = two_emulated_hosts
    assert r.returncode == 0, r.stdout + r.stderr
    for g, l in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"INFO rank={g} size=4 local_rank={l} local_size=2" in r.stdout


@pytest.mark.parametrize("mode", HIERARCHICAL)
def test_hierarchical_results_exact(two_emulated_hosts, mode):
    r, before, after = two_emulated_hosts
    assert_ok(r, 4, mode)
    assert after == before  # the job left no segment behind


def test_16_bit_sums_across_three_hosts_round_once():
    """bf16/fp16 across 3 emulated hosts: bit-exact against the contract (each host's partial
    rounded for the wire, the partials added in float32 and rounded once), within a bound that does
    not grow with the number of hosts."""
    assert_ok(mpi_launch(6, W, "compressed", per_host=2), 6, "compressed")


def test_launcher_hands_off_to_mpirun():
    r = launch(2, W, "info", launcher_args=["--hosts", "localhost:2"], env=MPI_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout
