"""Fixtures shared by tests/unit, tests/multiproc and tests/faults. Helpers that start programs
(the launcher, mpirun, any command under a timeout) live next to this file, in _launch.py."""

import numpy as np
import pytest

import fastxfer as fx
from fastxfer import _core


@pytest.fixture(params=fx.supported_simd_levels())
def simd(request):
    """Runs a test once on every kernel path this CPU supports, then restores the best one."""
    before = fx.simd_level()
    _core._set_simd_level(request.param)
    try:
        yield request.param
    finally:
        _core._set_simd_level(before)


@pytest.fixture
def rng():
    return np.random.default_rng(20261202)


# ---- JPEGs and packs for the data tests ------------------------------------------------------

def _jpeg_pixels(h, w, rng, content, color):
    if color is not None:  # one flat colour with a little texture
        img = np.empty((h, w, 3), np.uint8)
        img[:] = color
        img += rng.integers(0, 3, img.shape, dtype=np.uint8)
        return img
    if content == "noise":  # uniform noise: the worst case for the entropy coder
        return rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    if content == "photo":  # smooth colour with texture: compresses like a photograph
        seed = int(rng.integers(0, 7))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        img = np.stack([128 + 100 * np.sin(x / (7 + seed) + y / 23), 128 + 90 * np.cos(y / (5 + seed)),
                        (x * 3 + y * 2 + seed * 40) % 256], -1)
        img += rng.normal(0, 12, img.shape)
        return np.clip(img, 0, 255).astype(np.uint8)
    raise ValueError(f"content must be 'noise' or 'photo', not {content!r}")


def _make_jpeg(h, w, seed=0, content="noise", kind="444", quality=90, color=None) -> bytes:
    """JPEG bytes of an h x w image, encoded by Pillow (libjpeg-turbo).

    seed: an int, or a numpy Generator to draw from (a test making many images from one stream);
    content: "noise" or "photo", or color=(r, g, b) for a flat colour with a little texture;
    kind: "444", "422", "420" (chroma subsampling), "progressive" (4:2:0) or "gray"."""
    import io

    from PIL import Image

    img = _jpeg_pixels(h, w, np.random.default_rng(seed), content, color)
    buf = io.BytesIO()
    if kind == "gray":
        Image.fromarray(img[..., 0]).save(buf, "JPEG", quality=quality)
    else:
        sub = {"444": 0, "422": 1, "420": 2, "progressive": 2}[kind]
        Image.fromarray(img).save(buf, "JPEG", quality=quality, subsampling=sub, progressive=kind == "progressive")
    return buf.getvalue()


@pytest.fixture(scope="session")
def make_jpeg():
    """The data tests' one JPEG factory: make_jpeg(h, w, seed=0, content="noise", kind="444",
    quality=90, color=None) -> bytes (see _make_jpeg)."""
    pytest.importorskip("PIL.Image")
    return _make_jpeg


def _corrupt_record(path, record: int, at: int = 50) -> None:
    """Flips every bit of one byte, `at` bytes into `record` of the pack at `path`: that record's
    checksum no longer matches; the index and every other record stay intact."""
    from fastxfer.data import PackedDataset

    with PackedDataset(str(path), verify=False) as ds:
        assert at < int(ds.index[record]["size"]), f"record {record} is shorter than {at + 1} bytes"
        off = int(ds.index[record]["offset"]) + at
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="session")
def corrupt_record():
    """corrupt_record(path, record, at=50): damages one record of a pack (see _corrupt_record)."""
    return _corrupt_record


# ---- Keras jobs shared by several tests --------------------------------------------------------
# Starting TensorFlow takes 8 s of CPU per process here, more than most Keras scenarios themselves.
# Keras 3's fit scenarios run in one 2-rank job of tests/workers/keras_worker.py (tf-keras's are the last
# script of TF_KERAS_SCRIPTS), started the first time a test asks for it; each test then checks its own
# scenario's `OK` lines. The scenario after which the engine has failed (None gradients that differ: a
# MismatchError) comes last.


@pytest.fixture(scope="session")
def keras_job(tmp_path_factory):
    """(CompletedProcess, checkpoint directory) of the Keras 3 job: fit in every mode, SyncBatchNormalization,
    the callbacks (checkpointing into that directory), model averaging, early stopping, None gradients."""
    pytest.importorskip("tensorflow")
    from _launch import KERAS_FIT_MODES, launch

    ckdir = tmp_path_factory.mktemp("keras_callbacks")
    r = launch(2, "keras_worker.py", "seq", f"fit={KERAS_FIT_MODES}", "syncbn", f"callbacks={ckdir}", "averaging",
               "earlystop", "nonegrads", env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=1200)
    return r, ckdir


# The scripts that need no job of their own run one after the other in one job of
# tests/workers/run_scripts.py per rank count and environment (_launch.KERAS3_SCRIPTS,
# KERAS3_SCRIPTS_3, TF_KERAS_SCRIPTS, BRIDGE_SCRIPTS), each in a directory of its own; tests read
# their script's output with _launch.script_output.

SCRIPTS_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "0", "FASTXFER_TF_NATIVE": "1"}


def _scripts_job(tmp_path_factory, np_, table, env=None):
    """(CompletedProcess, directory) of one job of `table`'s scripts, each in <directory>/<name>."""
    pytest.importorskip("tensorflow")
    import os

    from _launch import ROOT, launch_scripts

    base = tmp_path_factory.mktemp(f"scripts_{np_}")
    scripts = []
    for name, (script, args) in table.items():
        (base / name).mkdir()
        args = [a.format(dir=base / name) for a in args]
        for a in args:
            if a.endswith("/") and a.startswith(str(base / name)):
                os.makedirs(a)
        scripts.append((name, base / name, os.path.join(ROOT, script), args))
    r = launch_scripts(np_, scripts, env={**SCRIPTS_ENV, **(env or {})}, timeout=1500)
    return r, base


@pytest.fixture(scope="session")
def keras3_scripts_job(tmp_path_factory):
    """The 2-rank job of _launch.KERAS3_SCRIPTS: (CompletedProcess, directory)."""
    from _launch import KERAS3_SCRIPTS

    return _scripts_job(tmp_path_factory, 2, KERAS3_SCRIPTS)


@pytest.fixture(scope="session")
def keras3_three_ranks_job(tmp_path_factory):
    """The 3-rank job of _launch.KERAS3_SCRIPTS_3: (CompletedProcess, directory)."""
    from _launch import KERAS3_SCRIPTS_3

    return _scripts_job(tmp_path_factory, 3, KERAS3_SCRIPTS_3)


@pytest.fixture(scope="session")
def tf_keras_scripts_job(tmp_path_factory):
    """The 2-rank tf-keras job of _launch.TF_KERAS_SCRIPTS: (CompletedProcess, directory)."""
    pytest.importorskip("tf_keras")
    from _launch import TF_KERAS_SCRIPTS

    return _scripts_job(tmp_path_factory, 2, TF_KERAS_SCRIPTS, {"TF_USE_LEGACY_KERAS": "1"})


@pytest.fixture(scope="session")
def bridge_scripts_job(tmp_path_factory):
    """The 2-rank job of _launch.BRIDGE_SCRIPTS through the numpy_function bridge: (CompletedProcess, directory)."""
    from _launch import BRIDGE_SCRIPTS

    return _scripts_job(tmp_path_factory, 2, BRIDGE_SCRIPTS, {"FASTXFER_TF_NATIVE": "0"})
