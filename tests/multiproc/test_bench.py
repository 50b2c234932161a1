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
