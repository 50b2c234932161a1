"""The MPI bridge in one process: a job that looks started by mpirun, without mpi4py, says what
to install."""

import os
import sys

from _launch import run_command


def test_mpirun_without_mpi4py_says_what_to_install(tmp_path):
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('mpi4py is hidden for this test')\n")
    e = dict(os.environ, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", PYTHONPATH=str(tmp_path))
    r = run_command([sys.executable, "-c", "import fastxfer as fx; fx.init()"], env=e, timeout=120)
    assert r.returncode != 0
    assert "pip install 'fastxfer[mpi]'" in r.stderr and "Open MPI" in r.stderr
