"""Jobs started where Horovod users start them (issue 31), each by the real launcher: Open MPI's
mpirun, MPICH's and Intel MPI's mpiexec (their PyPI wheels), Slurm's srun with and without --mpi
(a one-node Slurm these tests start and stop), torchrun, TF_CONFIG (as TFJob sets it) and
horovodrun (fastxfer run under Horovod's name, with Horovod's flags). Each forms one job of 2 with
exact results; a launcher that announces 2 where the job cannot form fails with an error naming the
launcher and the fix, never trains alone.

Slurm, MPICH, Intel MPI and torch come from .ci/launchers.sh (root, run by .ci/run); a test whose
launcher is not installed skips saying how to install it."""

import json
import os
import re
import shutil
import sys

import pytest

import _slurm
from _launch import MPI_ENV, MPIRUN, WORKERS, assert_ok, needs_mpi, run_command

W = os.path.join(WORKERS, "launcher_worker.py")
CI = "/opt/fastxfer-ci"
ENV = {"FASTXFER_ATTACH_TIMEOUT": "60"}
NO_SEGMENT_LEFT = re.compile(r"fastxfer-\d+-")


def env(extra=None):
    full = {**os.environ, **ENV, **(extra or {})}
    for k in [k for k in full if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "HOROVOD_"))
              or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TF_CONFIG", "MASTER_ADDR")]:
        if k not in (extra or {}):
            del full[k]
    return full


def job_of_two(r, source):
    """Both ranks printed OK with the layout from `source`, the place variables consistent."""
    lines = assert_ok(r, 2, "launch")
    for rank, line in enumerate(lines):
        assert f"rank {rank} of 2 source={source!r} local={rank}/2" in line, line
    return lines


def place(line):
    return json.loads(line.split(" place=", 1)[1])


def needs(path, what):
    return pytest.mark.skipif(not os.path.exists(path), reason=f"needs {what} (bash .ci/launchers.sh, as root)")


# ---- MPI launchers ------------------------------------------------------------------------------

@needs_mpi
def test_open_mpi_mpirun():
    r = run_command([MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, W],
                    env=env(MPI_ENV))
    job_of_two(r, "Open MPI mpirun")


@pytest.mark.parametrize("name,prefix,source,extra,args", [
    pytest.param("mpich", f"{CI}/mpich", "MPICH mpiexec", {}, [],
                 marks=needs(f"{CI}/mpich/bin/mpiexec", "MPICH's mpiexec")),
    # -ordered-output: Intel MPI otherwise interleaves the two ranks' lines
    pytest.param("impi", f"{CI}/impi", "Intel MPI mpiexec", {"I_MPI_FABRICS": "shm"}, ["-ordered-output"],
                 marks=needs(f"{CI}/impi/bin/mpiexec", "Intel MPI's mpiexec")),
])
def test_hydra_mpiexec_from_the_wheels(name, prefix, source, extra, args):
    """mpi4py loads the launcher's own MPI (MPI4PY_LIBMPI, as with that MPI installed beside it)."""
    e = env({"MPI4PY_LIBMPI": f"{prefix}/lib/libmpi.so.12", "PATH": f"{prefix}/bin:{os.environ['PATH']}", **extra})
    r = run_command([f"{prefix}/bin/mpiexec", *args, "-n", "2", sys.executable, W], env=e)
    job_of_two(r, source)


# ---- Slurm --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _slurm.missing()
    if why:
        pytest.skip(f"Slurm: {why}")
    cluster = _slurm.Cluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("mpi", [None, "pmix", "pmi2"])
def test_srun(slurm, mpi):
    """srun -n 2 (--mpi=none, pmix, pmi2): one job of 2 on the node, formed without MPI."""
    cmd = ["srun", "-n", "2"] + ([f"--mpi={mpi}"] if mpi else []) + [sys.executable, W]
    r = run_command(cmd, env={**env(), **{"SLURM_CONF": slurm.conf}})
    job_of_two(r, f"Slurm srun --mpi={mpi}" if mpi else "Slurm srun")


def test_srun_rank_that_never_comes_is_named(slurm):
    """A task of the step that never calls init(): rank 0 fails naming it, within the attach timeout."""
    r = run_command(["srun", "-n", "2", sys.executable, W, "rank1-quits"],
                    env={**env({"FASTXFER_ATTACH_TIMEOUT": "3"}), "SLURM_CONF": slurm.conf})
    assert r.returncode != 0
    assert "Slurm srun announced 2 ranks on this host, but rank(s) 1 did not reach rank 0 within 3 s" in r.stderr, \
        r.stderr[-3000:]
    assert "OK launch" not in r.stdout


# ---- torchrun -----------------------------------------------------------------------------------

TORCH = f"{CI}/torch"


@needs(f"{TORCH}/torch", "torch for torchrun")
def test_torchrun():
    r = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", W],
                    env=env({"PYTHONPATH": TORCH}))
    job_of_two(r, "torchrun")


# ---- TF_CONFIG (TFJob) --------------------------------------------------------------------------

def _tf_config_job(hosts, extra=None):
    from _launch import finish, start

    procs = []
    for i in range(2):
        spec = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}}
        procs.append(start([sys.executable, W], env=env({"TF_CONFIG": json.dumps(spec), **(extra or {})})))
    return [finish(p) for p in procs]


def test_tf_config_on_one_host():
    results = _tf_config_job(["localhost:2222", "localhost:2223"])
    for i, r in enumerate(results):
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"OK launch rank {i} of 2 source='TF_CONFIG' local={i}/2" in r.stdout


def test_a_job_over_hosts_without_mpi_is_an_error_naming_the_launcher_and_the_fix():
    """TF_CONFIG's workers on two hosts: fastxfer joins hosts through MPI, which TFJob does not wire."""
    for r in _tf_config_job(["node-a:2222", "node-b:2222"]):
        assert r.returncode != 0 and "OK launch" not in r.stdout
        assert "TF_CONFIG (TF_CONFIG) says rank" in r.stderr and "of 2 over 2 hosts" in r.stderr, r.stderr[-2000:]
        assert "Launch it with one of: mpirun -np N" in r.stderr and "srun --mpi=pmix" in r.stderr


# ---- horovodrun ---------------------------------------------------------------------------------

def horovodrun():
    exe = shutil.which("horovodrun")
    return [exe] if exe else [sys.executable, "-c", "import sys; from fastxfer.cli import horovodrun; "
                                                    "sys.exit(horovodrun())"]


@pytest.fixture(scope="module")
def horovodrun_job(tmp_path_factory):
    """One horovodrun job for the checks below: Horovod's flags and settings, a timeline, output files."""
    d = tmp_path_factory.mktemp("horovodrun")
    cmd = horovodrun() + ["-np", "2", "-H", "localhost:2", "--timeline-filename", str(d / "t.json"),
                          "--timeline-mark-cycles", "--output-filename", str(d / "out"),
                          "--mpi-args", "--bind-to none", "--cycle-time-ms", "5", "--autotune", "--cache-capacity",
                          "0", "--hierarchical-allreduce", "--verbose", sys.executable, W, "timeline"]
    r = run_command(cmd, env=env({"HOROVOD_FUSION_THRESHOLD": str(3 << 20), "HOROVOD_CACHE_CAPACITY": "0",
                                  "HOROVOD_SOMETHING_NEW": "1"}), cwd=str(d))
    return r, d


def test_horovodrun_forms_the_job_and_gives_the_place_variables(horovodrun_job):
    r, _ = horovodrun_job
    lines = job_of_two(r, "fastxfer run")
    for rank, line in enumerate(lines):
        p = place(line)
        assert p.pop("cap") == 3 << 20  # HOROVOD_FUSION_THRESHOLD, in bytes, became the bucket cap
        assert p == {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(rank),
                     "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}


def test_horovodrun_flags_without_meaning_say_so_once(horovodrun_job):
    r, _ = horovodrun_job
    for flag in ("--cycle-time-ms", "--autotune", "--cache-capacity", "--hierarchical-allreduce"):
        said = [ln for ln in r.stderr.splitlines() if ln.startswith(f"fastxfer run: {flag}: accepted, no effect: ")]
        assert len(said) == 1, (flag, r.stderr[-3000:])
    assert "fastxfer run: --mpi-args: this job runs on one host without mpirun" in r.stderr
    assert f"fastxfer run: 2 ranks on this host: {sys.executable} " in r.stderr  # --verbose


def test_horovod_variables_without_meaning_are_named_in_one_warning(horovodrun_job):
    r, _ = horovodrun_job
    for rank in (0, 1):
        mine = [ln for ln in r.stderr.splitlines() if ln.startswith(f"[{rank}] ")]
        text = "\n".join(mine)
        assert text.count("HorovodSettingWarning: Horovod settings that change nothing") == 1, text[-3000:]
        assert "HOROVOD_CACHE_CAPACITY: no effect: no response cache" in text
        assert "HOROVOD_SOMETHING_NEW: not a Horovod variable fastxfer knows; ignored" in text
        assert "HOROVOD_FUSION_THRESHOLD" not in text  # honoured, not named


def test_horovodrun_writes_one_timeline_with_a_row_per_rank_on_one_clock(horovodrun_job):
    _, d = horovodrun_job
    events = json.loads((d / "t.json").read_text())
    assert sorted(os.listdir(d)) == ["out", "t.json"]  # no per-rank files left beside it
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        reduced = {e["tid"] for e in mine if e["ph"] == "X" and e["name"] == "allreduce"}
        lanes = {e["tid"]: e["args"]["name"] for e in mine if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {"sum", "grad0", "grad1", "grad2"} <= {lanes[t] for t in reduced}
        assert any(e["ph"] == "i" and e["name"] == "CYCLE_START" for e in mine)  # --timeline-mark-cycles
    times = [e["ts"] for e in events if "ts" in e]
    assert min(times) == 0 and max(times) < 600e6  # one clock, starting at zero: not two ranks' own origins
    # the same collective overlaps on both ranks: on one clock, rank 1's grad2 allreduce ends after rank 0's starts
    spans = {(e["pid"], e["tid"]): e for e in events if e["ph"] == "X" and e["name"] == "allreduce"}
    lane = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    a, b = spans[(0, lane[(0, "grad2")])], spans[(1, lane[(1, "grad2")])]
    assert a["ts"] <= b["ts"] + b["dur"] + 1e3 and b["ts"] <= a["ts"] + a["dur"] + 1e3, (a, b)


def test_horovodrun_output_filename_has_each_ranks_output(horovodrun_job):
    _, d = horovodrun_job
    for rank in (0, 1):
        out = (d / "out" / f"rank.{rank}" / "stdout").read_text()
        assert out.startswith(f"OK launch rank {rank} of 2 ") and "[" not in out.split("place=")[0]


def test_horovodrun_errors_show_its_own_usage():
    r = run_command(horovodrun() + ["-np", "2", "--no-such-flag", "python", W], env=env())
    assert r.returncode == 2
    assert r.stderr.startswith("usage: horovodrun ") and "unrecognized arguments: --no-such-flag" in r.stderr
