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
    assert "oversubscribed" not in r.stderr
    cpus = len(os.sched_getaffinity(0))
    r = run("-np", str(cpus + 1), "--", "true")  # more ranks than CPUs: it runs, and says so once
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(f"warning: {cpus + 1} ranks on {cpus} usable CPU") == 1, r.stderr
    assert "oversubscribed; each rank gets a share of a CPU" in r.stderr and f"-np {cpus} or fewer" in r.stderr
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no mpirun
    r = run("-np", "2", "--hosts", "a:1,b:1", "--", "true", env=env)
    assert r.returncode != 0 and "mpirun, which is not on PATH" in r.stderr
    # a name nothing resolves (.invalid, RFC 2606): said before mpirun starts, not "gone down" from its daemons
    r = run("-np", "4", "--hosts", "localhost:2,nosuchhost.invalid:2", "--", "true")
    assert r.returncode == 1 and "--hosts: cannot resolve 'nosuchhost.invalid' (" in r.stderr, r.stderr
    assert "gone down" not in r.stderr and "Traceback" not in r.stderr
    r = run("-np", "2", "--net", "10.0.0.0/24", "--", "true")
    assert r.returncode != 0 and "--launch-agent and --net go with --hosts" in r.stderr


def test_mpi_environment_for_hosts(capsys):
    from fastxfer.launch.mpirun import mpi_environment

    base = {"PATH": "/bin"}
    env = mpi_environment(4, [("h1", 2), ("h2", 2)], "/x/agent", "10.77.0.0/24", base=base, cores=2)
    assert env["PRTE_MCA_plm_ssh_agent"] == env["OMPI_MCA_plm_rsh_agent"] == "/x/agent"
    assert env["OMPI_MCA_btl_tcp_if_include"] == env["PRTE_MCA_oob_tcp_if_include"] == "10.77.0.0/24"
    # 2 ranks per host on 2 cores: Open MPI must yield while it waits, and the launcher says so
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert "Open MPI set to yield while it waits" in capsys.readouterr().err
    # plenty of cores: Open MPI's default; a user's own setting always wins
    env = mpi_environment(4, [("h1", 2), ("h2", 2)], None, None, base=base, cores=56)
    assert "OMPI_MCA_mpi_yield_when_idle" not in env and "PRTE_MCA_plm_ssh_agent" not in env
    env = mpi_environment(4, [("h1", 2), ("h2", 2)], None, None, base={**base, "OMPI_MCA_mpi_yield_when_idle": "0"},
                          cores=2)
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"


def test_mpirun_command_forwards_fastxfer_settings_to_every_host():
    import shutil

    import pytest

    from fastxfer.launch.mpirun import mpirun_command

    if shutil.which("mpirun") is None and shutil.which("mpiexec") is None:
        pytest.skip("no mpirun")
    cmd = mpirun_command(4, [("h1", 2), ("h2", 2)], ["python", "t.py"],
                         env={"PATH": "/bin", "FASTXFER_HOST_TIMEOUT": "2", "FASTXFER_NET_CHUNK_MB": "0"})
    assert cmd[1:5] == ["-np", "4", "--host", "h1:2,h2:2"]
    assert cmd[-2:] == ["python", "t.py"]
    pairs = [cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i] == "-x"]
    assert pairs == ["PYTHONUNBUFFERED=1", "FASTXFER_HOST_TIMEOUT", "FASTXFER_NET_CHUNK_MB"]


def test_a_rank_reporting_a_lost_host_is_noticed_by_the_launcher():
    import io

    from fastxfer.launch.mpirun import HostWatch

    out = io.StringIO()
    text = ("step 1\n"
            "fastxfer: rank 2: lost host h3, h4 (rank 6, 10): no heartbeat from it for 5.0 s across the network\n"
            "fastxfer: rank 0: lost host h3 (rank 4): no heartbeat from it for 5.1 s across the network\n")
    watch = HostWatch([(io.StringIO(text), out)])
    watch.join(5)
    assert out.getvalue() == text
    assert watch.heartbeat_lost == ["h3", "h4"] and watch.heartbeat_rank == 2 and watch.heartbeat_at is not None
    assert not watch.lost_any


def test_host_timeout_setting(monkeypatch):
    import pytest

    from fastxfer.comm.group import host_timeout
    from fastxfer.errors import FastxferError

    monkeypatch.delenv("FASTXFER_HOST_TIMEOUT", raising=False)
    assert host_timeout() == 5.0
    for text, want in (("0", 0.0), ("2.5", 2.5), (" 10 ", 10.0)):
        monkeypatch.setenv("FASTXFER_HOST_TIMEOUT", text)
        assert host_timeout() == want
    for bad in ("-1", "soon"):
        monkeypatch.setenv("FASTXFER_HOST_TIMEOUT", bad)
        with pytest.raises(FastxferError, match="FASTXFER_HOST_TIMEOUT"):
            host_timeout()


def test_launcher_imports_neither_benchmarks_nor_ml_dtypes():
    """`fastxfer run` starts every job: it must not pay for the benchmarks' imports (ml_dtypes alone
    took a second); `fastxfer bench NAME` still gets NAME's own arguments, and `bench --help` lists all."""
    import sys

    code = ("import sys; from fastxfer import cli; rc = cli.main(['run', '-np', '1', '--', sys.executable, '-c', "
            "'pass']); print(rc, sorted(m for m in sys.modules if m == 'ml_dtypes' or m.startswith('fastxfer.bench')))")
    r = run_command([sys.executable, "-c", code], timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "0 []", r.stdout + r.stderr
    r = run_command(fastxfer_cmd() + ["bench", "--help"], timeout=60, cwd=ROOT)
    from fastxfer.cli import BENCHMARKS

    assert r.returncode == 0 and all(name in r.stdout for name in BENCHMARKS), r.stdout
    r = run_command(fastxfer_cmd() + ["bench", "compress", "--help"], timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "--pack-mb" in r.stdout, r.stdout + r.stderr
    r = run_command(fastxfer_cmd() + ["bench", "compress", "--no-such-option"], timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "unrecognized arguments: --no-such-option" in r.stderr, r.stderr
