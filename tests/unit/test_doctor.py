"""`fastxfer doctor`: its JSON against what the installation really has, and the failures it names."""

import json
import os
import subprocess
import sys

import pytest

from _launch import fastxfer_cmd

import fastxfer
from fastxfer import _core, settings
from fastxfer.comm import group
from fastxfer.data.decoders.native import libjpeg_path, native_decoder_status


def doctor(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FASTXFER_")}
    e.update(env or {}, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(fastxfer_cmd() + ["doctor", *args], capture_output=True, text=True, timeout=600, env=e)


def _open_mpi_backing_files():
    return {n for n in os.listdir("/dev/shm") if n.startswith("sm_segment.")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def report():
    before = _open_mpi_backing_files()
    r = doctor("--json", "--np", "3", env={"FASTXFER_OOB_KB": "512", "FASTXFER_SHM_WINDOW_MB": "4"})
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout), r.returncode, _open_mpi_backing_files() - before


def test_doctor_leaves_nothing_in_dev_shm(report):
    """The MPI probe starts Open MPI as a singleton, which leaves a 16 MiB backing file in /dev/shm
    after MPI_Finalize unless told where to put it (doctor.check_mpi)."""
    assert report[2] == set()


def test_doctor_json_says_what_this_installation_has(report):
    rep, rc, _ = report
    assert rep["fastxfer"]["version"] == fastxfer.__version__
    assert rep["fastxfer"]["simd"]["active"] == _core.simd_level()
    assert rep["fastxfer"]["simd"]["supported"] == list(_core.supported_simd_levels())
    ok, why = native_decoder_status()
    assert rep["jpeg"] == {"available": ok, "detail": why, "libjpeg": libjpeg_path()}
    # /dev/shm: the bytes a 3-rank job's segment takes with these settings, as the engine lays it out
    need = _core.segment_bytes(3, 4 << 20, 512 * 1024, group.MAX_RECORDS)
    assert rep["shm"]["need_bytes"] == need and rep["shm"]["ranks"] == 3
    assert need > 3 * ((4 << 20) + 512 * 1024)  # every rank its window and out-of-band area, and more
    st = os.statvfs(rep["shm"]["dir"])
    assert rep["shm"]["size_bytes"] == st.f_blocks * st.f_frsize
    changed = {s["name"]: s["value"] for s in rep["settings"]}
    assert changed == {"FASTXFER_OOB_KB": 512, "FASTXFER_SHM_WINDOW_MB": 4}, changed
    assert rep["topology"]["precision_policy"] in ("float32", "mixed_bfloat16")
    assert rc == (0 if rep["ok"] else 1) and rep["ok"] == (rep["problems"] == [])


def test_doctor_reports_mpi_and_tensorflow_as_installed(report):
    rep, _, _ = report
    mpi, tf = rep["mpi"], rep["tensorflow"]
    try:
        import mpi4py
    except ImportError:
        assert mpi["mpi4py"] is None and mpi["library"] is None
    else:
        assert mpi["mpi4py"] == mpi4py.__version__
        assert mpi["library"] and mpi["thread_level"] in ("single", "funneled", "serialized", "multiple"), mpi
    try:
        import tensorflow as tf_module
    except ImportError:
        assert tf["tensorflow"] is None and not tf["native_ops"]
    else:
        assert tf["tensorflow"] == tf_module.__version__
        assert tf["native_ops"] is (settings.get("FASTXFER_TF_NATIVE") is True), tf


def test_doctor_fails_with_the_fix_for_a_typo_a_small_dev_shm_and_a_missing_requirement(tmp_path):
    # one run, three problems: a variable that is no setting, more ranks than this /dev/shm holds, and a
    # requirement this machine may not meet
    r = doctor("--np", "100000", "--require", "bf16", "--json", env={"FASTXFER_THREAD": "4"})
    rep = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert any(p.startswith("FASTXFER_THREAD is set but is no fastxfer setting") for p in rep["problems"])
    assert rep["shm"]["need_bytes"] > rep["shm"]["free_bytes"]
    assert any("a job of 100000 ranks needs" in p and "--shm-size" in p for p in rep["problems"]), rep["problems"]
    missing = rep["topology"]["precision_policy"] != "mixed_bfloat16"
    assert any("neither AMX nor AVX-512 BF16" in p for p in rep["problems"]) == missing
    assert len(rep["problems"]) == 2 + missing and not rep["ok"]
    # an unknown requirement, and a setting with a bad value: one line, exit code 2, as every fastxfer command
    bad = doctor("--require", "gpu")
    assert bad.returncode == 2 and "--require gpu: expected some of tensorflow" in bad.stderr
    r = doctor(env={"FASTXFER_OOB_KB": "lots"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "FASTXFER_OOB_KB='lots'" in r.stderr


def test_doctor_text_report_has_every_section():
    r = doctor()
    assert r.returncode in (0, 1), r.stderr
    for head in ("fastxfer " + fastxfer.__version__, "kernels", "JPEG decoder", "MPI", "TensorFlow", "/dev/shm",
                 "topology", "settings"):
        assert head in r.stdout, r.stdout
    assert sys.executable  # the same interpreter ran it (fastxfer_cmd)
