"""The packed dataset format and `fastxfer data pack/info`."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

simplejpeg = pytest.importorskip("simplejpeg")

from _launch import fastxfer_cmd  # noqa: E402

from fastxfer.data import CorruptRecordError, PackedDataset, PackedFormatError, pack, scan_image_folder  # noqa: E402


@pytest.fixture
def folder(tmp_path, make_jpeg):
    src = tmp_path / "src"
    sizes = {"cat": [(32, 48), (50, 20), (64, 64)], "dog": [(17, 33), (40, 40)], "emu": [(8, 8)]}
    files = []
    for c, dims in sizes.items():
        (src / c).mkdir(parents=True)
        for i, (h, w) in enumerate(dims):
            data = make_jpeg(h, w, seed=len(files), kind="gray" if c == "emu" else "444")
            (src / c / f"{i}.jpg").write_bytes(data)
            files.append((c, h, w, data))
    (src / "dog" / "notes.txt").write_text("not an image")
    (src / "dog" / "empty.jpg").write_bytes(b"")
    return src, files


def run(*args, **kw):
    return subprocess.run(fastxfer_cmd() + list(args), capture_output=True, text=True, timeout=300, **kw)


def test_pack_and_read_back(folder, tmp_path):
    src, files = folder
    out = tmp_path / "train.fxpack"
    r = run("data", "pack", str(src), str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "packed 6 images of 3 classes" in r.stdout and "(6 tiled)" in r.stdout
    assert "skipped 2 file(s)" in r.stderr and "notes.txt: not a readable JPEG" in r.stderr
    from fastxfer import _core

    with PackedDataset(str(out)) as ds:
        assert len(ds) == 6 and ds.classes == ["cat", "dog", "emu"]
        assert ds.labels.tolist() == [0, 0, 0, 1, 1, 2]
        assert list(zip(ds.heights.tolist(), ds.widths.tolist())) == [(h, w) for _, h, w, _ in files]
        for i, (c, h, w, data) in enumerate(files):
            rec = bytes(ds.record(i))
            # a lossless transcode: other bytes (restart marker per MCU), the very same pixels
            layout = _core.jpeg_tile_layout(rec)
            assert rec != data and _core.jpeg_tile_layout(data) is None
            assert layout.height == h and layout.width == w
            assert layout.rows * layout.mcu_h >= h and (layout.rows - 1) * layout.mcu_h < h
            colorspace = "GRAY" if c == "emu" else "RGB"
            np.testing.assert_array_equal(simplejpeg.decode_jpeg(rec, colorspace=colorspace),
                                          simplejpeg.decode_jpeg(data, colorspace=colorspace))
    info = json.loads(run("data", "info", str(out), "--json", "--verify").stdout)
    assert info["records"] == 6 and info["records_per_label"] == {"0": 3, "1": 2, "2": 1}
    assert info["corrupted_records"] == [] and info["height"] == [8, 64] and info["width"] == [8, 64]
    assert info["tiles"] is True and info["untiled"] == 0
    text = run("data", "info", str(out)).stdout
    assert "6 records" in text and "label 1 (dog): 2" in text and "tiled JPEGs (restart marker per MCU): 6 of 6" in text
    # --no-tiles stores every file byte for byte
    plain = tmp_path / "plain.fxpack"
    r = run("data", "pack", str(src), str(plain), "--no-progress", "--no-tiles", "--threads", "1")
    assert r.returncode == 0 and "tiled" not in r.stdout
    with PackedDataset(str(plain)) as ds:
        assert [bytes(ds.record(i)) for i in range(6)] == [data for *_, data in files]


def test_list_file_with_names_or_numbers(folder, tmp_path):
    src, files = folder
    lst = tmp_path / "list.txt"
    lst.write_text(f"# comment\nsrc/cat/0.jpg tabby\n{src}/dog/1.jpg rex\nsrc/cat/1.jpg tabby\n")
    out = tmp_path / "l.fxpack"
    assert run("data", "pack", str(lst), str(out), "--no-progress").returncode == 0
    with PackedDataset(str(out)) as ds:
        assert ds.labels.tolist() == [0, 1, 0] and ds.classes == ["tabby", "rex"] and ds.num_classes == 2
    lst.write_text(f"src/cat/0.jpg 3\n{src}/dog/1.jpg 7\n")
    assert run("data", "pack", str(lst), str(out), "--no-progress").returncode == 0
    with PackedDataset(str(out)) as ds:  # numbers: no names, classes 0..7
        assert ds.labels.tolist() == [3, 7] and ds.classes == [] and ds.num_classes == 8
    lst.write_text("just-a-path\n")
    r = run("data", "pack", str(lst), str(out), "--no-progress")
    assert r.returncode == 1 and "list.txt:1: expected 'path label'" in r.stderr


def test_corrupted_record_is_named(folder, tmp_path, corrupt_record):
    src, _ = folder
    out = tmp_path / "c.fxpack"
    items, classes = scan_image_folder(str(src))
    pack(items, str(out), classes, progress=False)
    corrupt_record(out, 3)
    with PackedDataset(str(out)) as ds:
        assert bytes(ds.record(2))  # others still read
        with pytest.raises(CorruptRecordError, match=r"record 3 \(label 1, \d+ bytes at offset \d+\) is corrupted"):
            ds.record(3)
        assert ds.verify_all() == [3]
    r = run("data", "info", str(out), "--verify")
    assert r.returncode == 1 and "1 corrupted record(s): [3]" in r.stdout


def test_truncated_and_damaged_files_are_detected(folder, tmp_path):
    src, _ = folder
    out = tmp_path / "t.fxpack"
    items, classes = scan_image_folder(str(src))
    pack(items, str(out), classes, progress=False)
    good = out.read_bytes()
    out.write_bytes(good[:-10])
    with pytest.raises(PackedFormatError, match="incomplete or truncated"):
        PackedDataset(str(out))
    out.write_bytes(good[:100])
    with pytest.raises(PackedFormatError, match="too short"):
        PackedDataset(str(out))
    damaged = bytearray(good)
    index_at = int.from_bytes(good[-64 + 16:-64 + 24], "little")
    damaged[index_at] ^= 1
    out.write_bytes(bytes(damaged))
    with pytest.raises(PackedFormatError, match="index is corrupted"):
        PackedDataset(str(out))
    out.write_bytes(b"JUNK" * 2000)
    with pytest.raises(PackedFormatError, match="not a fastxfer pack"):
        PackedDataset(str(out))
    r = run("data", "info", str(out))
    assert r.returncode == 1 and "fastxfer data:" in r.stderr and "not a fastxfer pack" in r.stderr


def test_failed_pack_leaves_nothing_that_looks_valid(folder, tmp_path, monkeypatch):
    src, _ = folder
    out = tmp_path / "a.fxpack"
    items, classes = scan_image_folder(str(src))
    pack(items, str(out), classes, progress=False)
    before = out.read_bytes()
    import fastxfer.data.writer as writer

    calls = {"n": 0}
    real = writer._jpeg_header

    def failing(data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(data)

    monkeypatch.setattr(writer, "_jpeg_header", failing)
    with pytest.raises(KeyboardInterrupt):
        pack(items, str(out), classes, progress=False)
    assert out.read_bytes() == before  # the old pack is untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


STUCK_PACK = """
import sys, threading
import fastxfer.data.writer as writer
real = writer._read
def stuck(path):  # a read that never returns, as on a hung network file system
    if path.endswith("slow.jpg"):
        threading.Event().wait()
    return real(path)
writer._read = stuck
from fastxfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_killed_pack_never_produces_the_output(folder, tmp_path):
    src, _ = folder
    slow = tmp_path / "slow.jpg"
    slow.write_bytes((src / "cat" / "0.jpg").read_bytes())
    lst = tmp_path / "list.txt"
    lst.write_text(f"{src}/cat/0.jpg 0\n{slow} 1\n")
    out = tmp_path / "k.fxpack"
    p = subprocess.Popen([sys.executable, "-c", STUCK_PACK, "data", "pack", str(lst), str(out), "--no-progress"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(n.endswith(".partial") for n in os.listdir(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert p.poll() is None, "the packer was not stuck on slow.jpg"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert not out.exists()
    partial = [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    assert len(partial) == 1
    with pytest.raises(PackedFormatError):
        PackedDataset(str(tmp_path / partial[0]))


def test_a_folder_of_pngs_is_an_error_and_writes_nothing(tmp_path):
    """A folder without a single JPEG (PNGs here, made with Pillow) must not give an empty pack and exit 0:
    exit 1, one line naming the files' kind and what to do, and nothing at the output path."""
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "src" / c / f"{i}.png")
    out = tmp_path / "out.fxpack"
    r = run("data", "pack", str(tmp_path / "src"), str(out), "--no-progress")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "none of the 4 file(s) is a JPEG that can be packed (.png;" in r.stderr, r.stderr
    assert "0.png: not a readable JPEG" in r.stderr and "fastxfer packs JPEG files only" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    assert os.listdir(tmp_path) == ["src"]  # no temporary file left beside it either
    with pytest.raises(Exception, match="nothing to pack into .*: no files were given"):
        pack([], str(out))
