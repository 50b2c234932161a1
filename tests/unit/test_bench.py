"""`fastxfer bench compress` runs end to end through the installed command and checks its own results."""

import json

import pytest

from _launch import fastxfer_cmd, run_command


def test_bench_compress_json(tmp_path):
    out = tmp_path / "r.json"
    r = run_command(fastxfer_cmd() + ["bench", "compress", "--no-peers", "--size-mb", "2", "--pack-mb", "2",
                                      "--reps", "1", "--threads", "1,2", "--json", str(out)],
                    timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    ours = [row for row in res["rows"] if row["impl"].startswith("fastxfer") and row["wrong"] is not None]
    assert {row["op"] for row in ours} >= {"f32->bf16", "f32->fp16", "bf16->f32", "fp16->f32", "pack 100 tensors"}
    assert all(row["wrong"] == 0 for row in ours)
    assert {row["threads"] for row in ours} == {"1", "2"}
    assert res["machine"]["simd_level"] and res["elements"] > 0
    assert len(res["targets"]) == 5  # both baselines ran at 1 thread, pack at both thread counts
    assert "fastxfer bench compress" in r.stdout  # the human-readable table went to stdout


def test_bench_rejects_unknown_benchmark(tmp_path):
    r = run_command(fastxfer_cmd() + ["bench", "nonsense"], timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "invalid choice: 'nonsense'" in r.stderr


def test_version(tmp_path):
    import fastxfer

    r = run_command(fastxfer_cmd() + ["--version"], timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"fastxfer {fastxfer.__version__}"


def test_bench_pipeline_smoke(tmp_path):
    pytest.importorskip("skimage")  # the JPEG sets are cut from scikit-image's photographs
    out = tmp_path / "pipe.json"
    r = run_command(fastxfer_cmd() + ["bench", "pipeline", "--images", "8", "--reps", "1", "--batch", "4", "--no-tf",
                                      "--json", str(out)], timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {row["set"] for row in rows} == {"500x375", "1000x750"}
    assert all(row["images_s"] > 0 and row["cpu"] > 0 for row in rows)
    assert any(row["pipeline"] == "fastxfer Loader, simplejpeg + Numba" and row["mode"] == "train" for row in rows)
    from fastxfer.data.decoders.native import native_decoder_status

    if native_decoder_status()[0]:
        assert any(row["pipeline"] == "fastxfer Loader" and row["mode"] == "train" for row in rows)
        assert any(row["pipeline"].startswith("fastxfer decode of the crops alone") for row in rows)
        assert [k["kernel"] for k in res["kernels"]][0] == "fastxfer C++ resampler"
        assert res["kernels"][0]["vs_cpp"] == 1.0 and all(k["us_per_image"] > 0 for k in res["kernels"])
    assert {t["target"] for t in res["targets"]} >= {"train, 500x375: >= 70% of decode alone"}


def test_bench_allreduce_removes_only_deepspeeds_segments_of_its_job():
    """DeepSpeed never unlinks its /dev/shm segments; the benchmark removes exactly those of the job
    it ran (named by uid, address, port and rank) and nothing else."""
    import os

    from fastxfer.bench.allreduce import remove_deepspeed_segments
    from fastxfer.bench.workers.allreduce_worker import deepspeed_segments

    port = 1  # no job listens there: these names are this test's alone
    mine = deepspeed_segments(port, 3)
    assert mine == [f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_{r}" for r in range(3)]
    other = deepspeed_segments(2, 1)[0]
    try:
        for path in mine[:2] + [other]:
            with open(path, "wb") as f:
                f.write(b"x")
        assert remove_deepspeed_segments(port, 3) == mine[:2]  # rank 2's never existed
        assert not any(os.path.exists(p) for p in mine) and os.path.exists(other)
    finally:
        for path in mine + [other]:
            if os.path.exists(path):
                os.unlink(path)


def test_bench_allreduce_says_why_a_peer_is_skipped(monkeypatch):
    from fastxfer.bench import allreduce

    monkeypatch.setattr(allreduce, "_installed", lambda m: m == "torch")
    assert allreduce._missing("deepspeed").startswith("not installed (pip install deepspeed")
    assert allreduce._missing("fastxfer") is None and allreduce._missing("gloo") is None
    assert allreduce._missing("mpi4py") == "not installed"
    monkeypatch.setattr(allreduce, "_installed", lambda m: m == "deepspeed")
    assert allreduce._missing("deepspeed") == "deepspeed is installed but torch is not"
    assert allreduce._missing("ncl").startswith("unknown peer")


def test_bench_allreduce_repeats_alternate_the_peers_and_report_medians(monkeypatch):
    """`--repeat 3` on one host: the peers run as given, reversed, as given; every row is the median
    of its three p50s (kept in run order), and a peer that fails once is named with that run while
    its other two runs still count."""
    from fastxfer.bench import allreduce

    order, p50s = [], {"fastxfer": iter([3e-6, 1e-6, 2e-6]), "mpi4py": iter([5e-6, 9e-6, 7e-6]),
                       "gloo": iter([4e-4, 6e-4])}

    def launch(impl, np_, sizes, scale, tmp, collectives, bind):
        order.append(impl)
        if impl == "gloo" and len(order) == 4:  # gloo's run 2 of 3
            return [], "failed (exit 1): boom", {}
        return [{"impl": impl, "bytes": sizes[0], "p50": next(p50s[impl]), "wrong": 0}], None, {}

    monkeypatch.setattr(allreduce, "_launch", launch)
    monkeypatch.setattr(allreduce, "_missing", lambda impl: "not installed" if impl == "horovod" else None)
    res = allreduce.run(2, 4096, 4096, 4, 1.0, ("fastxfer", "horovod", "mpi4py", "gloo"), "none", ("allreduce",), 3)
    assert order == ["fastxfer", "mpi4py", "gloo", "gloo", "mpi4py", "fastxfer", "fastxfer", "mpi4py", "gloo"]
    rows = {r["impl"]: r for r in res["rows"]}
    assert [r["impl"] for r in res["rows"]] == ["fastxfer", "mpi4py", "gloo"]
    assert rows["fastxfer"]["p50"] == 2e-6 and rows["fastxfer"]["p50s"] == [3e-6, 1e-6, 2e-6]
    assert rows["mpi4py"]["p50"] == 7e-6 and rows["gloo"]["p50"] == 5e-4
    assert res["skipped"] == {"horovod": "not installed", "gloo": "failed (exit 1): boom, run 2 of 3"}
    assert res["repeat"] == 3 and rows["fastxfer"]["algbw"] == 4096 / 2e-6 / 1e9
