"""`fastxfer bench placement` runs its 2-rank jobs through the launcher in every configuration."""

import json

from _launch import fastxfer_cmd, run_command


def test_bench_placement_runs_all_configurations(tmp_path):
    out = tmp_path / "p.json"
    r = run_command(fastxfer_cmd() + ["bench", "placement", "--steps", "3", "--dim", "64", "--grads", "2",
                                      "--grad-mb", "0.1", "--json", str(out)],
                    timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["config"] for row in rows] == ["unbound", "unbound, engine threads pinned", "--bind numa"]
    assert rows[0]["speedup"] == 1.0 and all(row["step_ms"] > 0 for row in rows)
    # bound workers really ran on one CPU each (the plan splits this machine's cores)
    assert len(rows[2]["rank0_cpus"]) < len(rows[0]["rank0_cpus"]) or len(rows[0]["rank0_cpus"]) == 1


def _deepspeed_segments():
    import os

    return {n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_")}


def test_bench_allreduce_rows_targets_and_deepspeed(tmp_path):
    """The fastxfer rows (out=, fresh output, native bf16 arrays) are all exact; DeepSpeed's rows run
    where it is installed (and leave no /dev/shm segment behind), else the skip says why."""
    import importlib.util

    before = _deepspeed_segments()
    out = tmp_path / "a.json"
    r = run_command(fastxfer_cmd() + ["bench", "allreduce", "-b", "64K", "-e", "128K", "-f", "2", "--iters-scale",
                                      "0.1", "--peers", "fastxfer,deepspeed,intel-mpi", "--json", str(out)],
                    timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(row["impl"], row["bytes"]): row for row in res["rows"]}
    labels = ["fastxfer none", "fastxfer bf16", "fastxfer fp16", "fastxfer none fresh", "fastxfer bf16 array",
              "fastxfer bf16 array fresh"]
    if importlib.util.find_spec("deepspeed") is not None:
        from fastxfer import _core

        assert "deepspeed" not in res["skipped"], res["skipped"]
        labels += ["deepspeed fp32"]
        assert _deepspeed_segments() <= before  # cleaned up after it
        assert any(t["target"].startswith("fastxfer none fresh busbw >= deepspeed fp32") for t in res["targets"])
        if _core.cpu_features().avx512bw:
            labels += ["deepspeed bf16"]
            assert any(t["target"].startswith("fastxfer bf16 array fresh busbw >= deepspeed bf16")
                       for t in res["targets"])
        else:  # DeepSpeed's bf16 kernel needs AVX-512BW: that row alone is left out, and says why
            assert "AVX-512BW" in res["skipped"]["deepspeed bf16"], res["skipped"]
            assert not any(r["impl"] == "deepspeed bf16" for r in res["rows"])
    else:
        assert res["skipped"]["deepspeed"].startswith("not installed")
    for label in labels:
        for nbytes in (65536, 131072):
            row = rows[(label, nbytes)]
            assert row["wrong"] == 0 and row["p50"] > 0, row
            assert row["dtype"] == ("bfloat16" if label.endswith(("array", "array fresh", "bf16")) and
                                    not label == "fastxfer bf16" else "float32"), row
    # Intel MPI from its wheel (.ci/launchers.sh), under its own mpiexec, in its wait mode
    from fastxfer.bench.allreduce import hydra_prefix

    impi = "Intel MPI (I_MPI_WAIT_MODE=1) Allreduce"
    if hydra_prefix("intel-mpi"):
        assert "intel-mpi" not in res["skipped"], res["skipped"]
        for nbytes in (65536, 131072):
            assert rows[(impi, nbytes)]["wrong"] == 0 and rows[(impi, nbytes)]["p50"] > 0
        assert any(t["target"].startswith(f"fastxfer none at least as fast as {impi} at every size")
                   for t in res["targets"])
    else:
        assert res["skipped"]["intel-mpi"].startswith("not found: pip install --prefix DIR impi-rt")
    names = {t["target"].split(" at ")[0] for t in res["targets"]}
    assert {"fresh output busbw >= 0.9x out= busbw", "bf16 array elements/s >= float32 elements/s"} <= names
