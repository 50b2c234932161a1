"""The MPI paths: jobs started by mpirun (ranks found through mpi4py), `fastxfer run --hosts`, and
the hierarchical transport across hosts — emulated on this machine by giving ranks different
host identities (FASTXFER_HOST_ID), oversubscribed on 2 cores."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from _launch import WORKERS, fastxfer_cmd, fastxfer_segments

mpirun = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(mpirun is None or subprocess.run([sys.executable, "-c", "import mpi4py"]).returncode,
                                reason="needs mpirun and mpi4py (pip install 'fastxfer[mpi]')")
W = os.path.join(WORKERS, "collectives_worker.py")


def env(**extra):
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             FASTXFER_SHM_WINDOW_MB="0.25", FASTXFER_BUCKET_CAP_MB="0.5", FASTXFER_STREAM_MIN_MB="0.001")
    e.update(extra)
    return e


def mpi(np_, *args, per_host=None, timeout=300):
    """mpirun -np N python worker args; with per_host=k, ranks get host ids by rank // k."""
    cmd = [mpirun, "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    if per_host:
        inner = f"FASTXFER_HOST_ID=h$((OMPI_COMM_WORLD_RANK / {per_host})) exec {sys.executable} {W} " + " ".join(args)
        cmd += ["sh", "-c", inner]
    else:
        cmd += [sys.executable, W, *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd="/")


def test_mpirun_single_host_uses_shared_memory():
    r = mpi(2, "info")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=0 size=2 local_rank=0 local_size=2" in r.stdout
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout
    r = mpi(2, "sweep")
    assert r.returncode == 0 and r.stdout.count("OK sweep") == 2, r.stdout + r.stderr


def test_two_emulated_hosts_layout():
    r = mpi(4, "info", per_host=2)
    assert r.returncode == 0, r.stdout + r.stderr
    for g, l in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"INFO rank={g} size=4 local_rank={l} local_size=2" in r.stdout


@pytest.mark.parametrize("mode", ["sweep", "compressed", "collectives"])
def test_hierarchical_results_exact(mode):
    before = fastxfer_segments()
    r = mpi(4, mode, per_host=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(f"OK {mode}") == 4
    assert fastxfer_segments() == before


@pytest.mark.parametrize("kind", ["name", "count", "oob"])
def test_hierarchical_mismatch_on_every_rank(kind):
    r = mpi(4, "mismatch", kind, per_host=2)
    lines = [ln for ln in r.stdout.splitlines() if re.match(r"MISMATCH rank \d: ", ln)]
    assert len(lines) == 4, r.stdout + r.stderr
    assert len({ln.split(": ", 1)[1] for ln in lines}) == 1  # the same message on every rank
    assert r.stdout.count("STILL-MISMATCH") == 4  # and the group stays poisoned
    assert "NO ERROR" not in r.stdout


def test_uneven_hosts_are_refused():
    cmd = [mpirun, "-np", "3", "--oversubscribe", "--bind-to", "none", "sh", "-c",
           f"FASTXFER_HOST_ID=h$((OMPI_COMM_WORLD_RANK / 2)) exec {sys.executable} {W} info"]
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode != 0
    assert "hosts run different numbers of ranks (2, 1)" in r.stdout + r.stderr


def test_launcher_hands_off_to_mpirun():
    r = subprocess.run(fastxfer_cmd() + ["run", "-np", "2", "--hosts", "localhost:2", "--", sys.executable, W, "info"],
                       env=env(), capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO rank=1 size=2 local_rank=1 local_size=2" in r.stdout


def test_mpirun_without_mpi4py_says_what_to_install(tmp_path):
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('mpi4py is hidden for this test')\n")
    e = dict(os.environ, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import fastxfer as fx; fx.init()"], env=e, capture_output=True,
                       text=True, timeout=120, cwd="/")
    assert r.returncode != 0
    assert "pip install 'fastxfer[mpi]'" in r.stderr and "Open MPI" in r.stderr
