"""`fastxfer bench allreduce --hosts`: its parsing, its medians and its cost model, on rows whose
true alpha and beta are known (the launches themselves run in tests/multihost)."""

import os

import pytest

from _launch import fastxfer_cmd, run_command
from fastxfer.bench import hosts
from fastxfer.bench.harness import median_rows

MB = 1 << 20


def test_configs_and_rates_parse_and_bad_ones_say_what_is_wanted():
    assert hosts.parse_configs("2x2, 3X1") == [(2, 2), (3, 1)]
    for bad in ("1x4", "2x0", "2by2", ""):
        with pytest.raises(ValueError, match="HOSTSxRANKS"):
            hosts.parse_configs(bad)
    assert hosts.parse_rate("none") is None
    assert hosts.parse_rate("500mbit") == 500e6 and hosts.parse_rate("2.5gbit") == 2.5e9
    with pytest.raises(ValueError, match="tc rates"):
        hosts.parse_rate("fast")


def test_wire_formula_is_the_ring_optimum():
    assert hosts.wire_formula(2, 64 * MB) == 64 * MB
    assert hosts.wire_formula(3, 3 * MB) == 4 * MB
    assert hosts.wire_formula(4, 4 * MB) == 6 * MB


def test_repeats_become_medians_and_wrong_elements_add_up():
    runs = [[{"impl": "fastxfer none", "bytes": MB, "p50": p, "wrong": w, "wire_bytes": wb}]
            for p, w, wb in ((3.0, 0, 10), (1.0, 2, 30), (2.0, 1, 20))]
    (row,) = median_rows(runs)
    assert row["p50"] == 2.0 and row["p50s"] == [3.0, 1.0, 2.0]
    assert row["wrong"] == 3 and row["wire_bytes"] == 20


def _synthetic(alpha, beta, shm_a, shm_b, configs, rate_bits=None):
    """Rows a machine that follows the model exactly would measure, with its shared-cores factor
    taken from this process's CPUs as the fit takes it."""
    sizes = [4 * MB, 16 * MB, 64 * MB]
    res = {"configs": configs, "rows": [],
           "one_host": {str(k): [{"impl": i, "bytes": s, "p50": shm_a + shm_b * s} for i in hosts.ROWS_FX
                                 for s in sizes] for _, k in configs}}
    cores = max(1, len(os.sched_getaffinity(0)))
    for h, k in configs:
        for impl in hosts.ROWS_FX:
            for s in sizes:
                wire = s // 2 if impl == "fastxfer bf16" else s
                t = shm_a + shm_b * s + 2 * (h - 1) * alpha + hosts.wire_formula(h, wire) * beta * max(1, h / cores)
                res["rows"].append({"hosts": h, "slots": k, "rate": "none", "rate_bits": None, "impl": impl,
                                    "bytes": s, "p50": t})
    return res


def test_the_cost_model_recovers_alpha_and_beta_and_predicts_the_other_configurations():
    alpha, beta = 300e-6, 1 / 0.5e9
    res = _synthetic(alpha, beta, 1e-4, 1 / 5e9, [(2, 1), (2, 2), (3, 1)])
    model = hosts.fit_model(res)
    assert model["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert model["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert model["calibrated_on"] == "2x1"
    assert len(model["table"]) == 3 * 2 * 3
    assert all(abs(t["error"]) < 1e-6 for t in model["table"])
    assert sum(t["calibration"] for t in model["table"]) == 3  # 2x1 float32: the fit's own points
    # a model that is wrong for one configuration says so, by how much
    for r in res["rows"]:
        if (r["hosts"], r["slots"]) == (2, 2):
            r["p50"] *= 2
    model = hosts.fit_model(res)
    errs = {round(t["error"], 6) for t in model["table"] if t["config"] == "2x2"}
    assert errs == {-0.5}


def test_a_rate_limited_link_is_predicted_at_the_links_speed():
    res = _synthetic(0.0, 1 / 2e9, 0.0, 1e-12, [(2, 1)])
    # the link's time for the bytes on the wire (bf16: half), as a token bucket would allow
    slow = [dict(r, rate="100mbit", rate_bits=100e6, p50=r["bytes"] / (2 if r["impl"] == "fastxfer bf16" else 1)
                 * 8 / 100e6) for r in res["rows"]]
    res["rows"] += slow
    model = hosts.fit_model(res)
    for t in model["table"]:
        if t["rate"] == "100mbit":
            assert t["error"] == pytest.approx(0.0, abs=1e-3), t


def test_bench_hosts_rejects_a_bad_configuration(tmp_path):
    r = run_command(fastxfer_cmd() + ["bench", "allreduce", "--hosts", "1x2"], timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "HOSTSxRANKS" in r.stderr
