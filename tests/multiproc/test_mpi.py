"""The MPI paths: jobs started by mpirun (ranks found through mpi4py), `fastxfer run --hosts`, and
the hierarchical transport across hosts — emulated on this machine by giving ranks different
host identities (FASTXFER_HOST_ID), oversubscribed on 2 cores."""

import os
import re
import sys

import pytest

from _launch import (MPI_ENV, WORKERS, assert_ok, fastxfer_segments, launch, launch_env, mpi_launch, needs_mpi,
                     private_shm, run_command)

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
    HIERARCHICAL mode (mpirun starts once), its segments in a folder of their own; (job, the segments
    there before it: none, the segments it left there)."""
    with private_shm() as (env, folder):  # a folder of its own: other tests' jobs may run meanwhile
        r = mpi_launch(4, W, ",".join(["info", *HIERARCHICAL]), per_host=2, env=env)
        return r, [], fastxfer_segments(folder)


def test_two_emulated_hosts_layout(two_emulated_hosts):
    r, _, _ = two_emulated_hosts
    assert r.returncode == 0, r.stdout + r.stderr
    for g, l in ((0, 0), (1, 1), (2, 0), (3, 1)):
        # the engine calls Open MPI's C API itself (csrc/transport/mpi_native.h), by default
        assert f"INFO rank={g} size=4 local_rank={l} local_size=2 link=native MPI (openmpi)" in r.stdout


@pytest.mark.parametrize("mode", HIERARCHICAL)
def test_hierarchical_results_exact(two_emulated_hosts, mode):
    r, before, after = two_emulated_hosts
    assert_ok(r, 4, mode)
    assert after == before  # the job left no segment behind


def test_oob_allreduce_that_disagrees_across_hosts_is_a_mismatch_on_every_rank():
    """The native link's own agreement check (oob_allreduce compares what every rank submitted
    before any data moves): every rank raises naming ranks 0 and 1."""
    r = mpi_launch(4, W, "mismatch", "oob", per_host=2)
    msg = ("oob_allreduce: rank 0 submitted allreduce 'm' float64[2] op=average prescale=1 postscale=0.25 but rank 1 "
           "submitted allreduce 'm' float64[3]")
    for g in range(4):
        assert f"MISMATCH rank {g}: {msg}" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_the_mpi4py_link_still_works():
    """FASTXFER_NATIVE_MPI=0: the network stage through mpi4py (the path an MPI whose ABI the native
    link does not know takes), exact like the native one."""
    r = mpi_launch(4, W, "info,sweep,collectives", per_host=2, env={"FASTXFER_NATIVE_MPI": "0"})
    for g in range(4):
        assert f"INFO rank={g} size=4" in r.stdout and "link=mpi4py" in r.stdout, r.stdout + r.stderr
    for mode in ("sweep", "collectives"):
        assert_ok(r, 4, mode)


CI = "/opt/fastxfer-ci"


@pytest.mark.parametrize("prefix,extra", [
    pytest.param(f"{CI}/mpich", {}, id="mpich",
                 marks=pytest.mark.skipif(not os.path.exists(f"{CI}/mpich/bin/mpiexec"),
                                          reason="needs MPICH's wheel (bash .ci/launchers.sh, as root)")),
    # Intel MPI spins in its waits by default: 4 ranks on 2 cores need its wait mode
    pytest.param(f"{CI}/impi", {"I_MPI_WAIT_MODE": "1"}, id="intel-mpi",
                 marks=pytest.mark.skipif(not os.path.exists(f"{CI}/impi/bin/mpiexec"),
                                          reason="needs Intel MPI's wheel (bash .ci/launchers.sh, as root)")),
])
def test_the_native_link_on_the_mpich_abi(prefix, extra):
    """The same wheel on MPICH and Intel MPI (the MPICH ABI: int handles, MPI_BYTE 0x4c00010d):
    mpi4py loads that MPI (MPI4PY_LIBMPI), the engine finds its C API in it; 2 emulated hosts x 2
    ranks under their own mpiexec, every result exact."""
    modes = ["sweep", "collectives", "compressed"]
    program = os.path.join(WORKERS, W)
    inner = f"FASTXFER_HOST_ID=h$((PMI_RANK / 2)) exec {sys.executable} {program} info,{','.join(modes)}"
    env = launch_env({"MPI4PY_LIBMPI": f"{prefix}/lib/libmpi.so.12", "PATH": f"{prefix}/bin:{os.environ['PATH']}",
                      **extra})
    r = run_command([f"{prefix}/bin/mpiexec", "-n", "4", "sh", "-c", inner], env=env)
    # hydra forwards each rank's output in the pieces it reads, so lines of two ranks can run together
    r.stdout = re.sub(r"(?<!\n)(OK |INFO )", r"\n\1", r.stdout)
    for g, l in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"INFO rank={g} size=4 local_rank={l} local_size=2 link=native MPI (mpich)" in r.stdout, \
            r.stdout[-3000:] + r.stderr[-3000:]
    for mode in modes:
        assert_ok(r, 4, mode)


def test_16_bit_sums_across_three_hosts_round_once():
    """bf16/fp16 across 3 emulated hosts: bit-exact against the contract (each host's partial
    rounded for the wire, the partials added in float32 and rounded once), within a bound that does
    not grow with the number of hosts."""
    assert_ok(mpi_launch(6, W, "compressed", per_host=2), 6, "compressed")


def test_launcher_hands_off_to_mpirun():
    r = launch(2, W, "info", launcher_args=["--hosts", "localhost:2"], env=MPI_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout
