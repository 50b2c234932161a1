"""fastxfer.data under bad and forged input (issue 14): real packs, real JPEGs, the real loader
with both decoders. A forged pack has its CRCs recomputed, so only the new checks can catch it.

- an index whose height/width disagrees with the JPEG: a skipped, counted, warned record on both
  decoders (the Numba kernel used to read out of bounds: run in a subprocess, so a regression
  fails the test instead of killing pytest);
- list-file labels: negative numbers and numbers mixed with names are errors naming the line;
- forged index fields and metadata: PackedFormatError naming the record and the field;
- a batch with no readable record: filled from other records, counted, warned; len() holds;
- pack: every file it skips (FIFO, dangling or looping link, sub-folder, device) is counted with
  its reason.
"""

import json
import os
import subprocess
import sys
import threading
import warnings
import zlib

import numpy as np
import pytest

pytest.importorskip("simplejpeg")
pytest.importorskip("numba")

from _launch import fastxfer_cmd, run_command  # noqa: E402

from fastxfer.data import Loader, PackedDataset, PackedFormatError, pack, read_list_file  # noqa: E402
from fastxfer.data.format import FOOTER, INDEX_DTYPE  # noqa: E402
from fastxfer.errors import FastxferError  # noqa: E402

COLORS = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200]], np.uint8)
MEAN = np.zeros(3, np.float32)
STD = np.full(3, 1 / 255, np.float32)  # outputs in pixel units
H, W = 40, 60  # every image of the small packs


@pytest.fixture
def small_pack(tmp_path, make_jpeg):
    """small_pack(n=6) -> a tiled pack of n 40x60 JPEGs, record i of class i % 3 in its colour."""
    def build(n=6, name="d.fxpack"):
        items = []
        for i in range(n):
            p = tmp_path / f"img{i}.jpg"
            p.write_bytes(make_jpeg(H, W, seed=i, color=COLORS[i % 3], quality=95))
            items.append((str(p), i % 3))
        out = tmp_path / name
        pack(items, str(out), ["red", "green", "blue"], progress=False)
        return out
    return build


def forge(path, record=None, meta=None, **fields):
    """Rewrites index fields of `record` and/or the metadata bytes of the pack at `path`, with the
    index and metadata CRCs recomputed: the file is consistent, only its values are wrong."""
    with open(path, "rb") as f:
        data = f.read()
    magic, count, index_at, meta_at, meta_len, _, _ = FOOTER.unpack_from(data, len(data) - FOOTER.size)
    index = np.frombuffer(data[index_at:meta_at], INDEX_DTYPE).copy()
    for k, v in fields.items():
        index[record][k] = v
    raw = index.tobytes()
    m = data[meta_at:meta_at + meta_len] if meta is None else meta
    with open(path, "wb") as f:
        f.write(data[:index_at] + raw + m)
        f.write(FOOTER.pack(magic, count, index_at, index_at + len(raw), len(m), zlib.crc32(raw), zlib.crc32(m)))


def colour_of(image):
    m = image.reshape(-1, 3).mean(0)
    return int(np.argmin(((COLORS.astype(np.float32) - m) ** 2).sum(1)))


def loader(path, **kw):
    for k, v in dict(rank=0, size=1, threads=2, mean=MEAN, std=STD).items():
        kw.setdefault(k, v)
    return Loader(str(path), **kw)


# ---- row 5: an index size that disagrees with the JPEG header ---------------------------------

WRONG_SIZE = r"""
import json, logging, sys, warnings
import numpy as np
from fastxfer.data import Loader
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("fastxfer").addHandler(Keep(logging.WARNING))
decoder, colors = sys.argv[1], np.array(json.loads(sys.argv[2]), np.float32)
out = {}
for path in sys.argv[3:]:
    for train, size, epochs in ((True, 64, 3), (True, 224, 2), (False, 32, 1)):
        ld = Loader(path, 6, image_size=size, train=train, decoder=decoder, rank=0, size=1, threads=2,
                    mean=np.zeros(3, np.float32), std=np.full(3, 1 / 255, np.float32))
        messages, consistent = [], True
        said.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for e in range(epochs):
                ld.set_epoch(e)
                for images, labels in ld:
                    means = images.reshape(len(images), -1, 3).mean(1)
                    seen = np.argmin(((means[:, None, :] - colors[None]) ** 2).sum(2), 1)
                    consistent &= bool(np.isfinite(images).all()) and seen.tolist() == labels.tolist()
        out[f"{path} {train}-{size}"] = {"skipped": ld.skipped, "epochs": epochs, "consistent": consistent,
                                         "messages": said + [str(w.message) for w in caught]}
        ld.close()
print("RESULT", json.dumps(out))
"""
CLAIMS = [(65535, 60), (4000, 4000), (20, 30)]  # (height, width) in the index; the JPEGs are 40x60


@pytest.mark.parametrize("decoder", ["numba", "native"])
def test_index_size_that_disagrees_with_the_jpeg_is_a_skipped_record(small_pack, decoder):
    paths = []
    for h, w in CLAIMS:
        paths.append(small_pack(name=f"{w}x{h}.fxpack"))
        forge(paths[-1], 1, height=h, width=w)
    # a subprocess: the Numba kernel used to read out of bounds here (SIGSEGV at 60x65535)
    r = subprocess.run([sys.executable, "-c", WRONG_SIZE, decoder, json.dumps(COLORS.tolist())] + list(map(str, paths)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the loader died (rc {r.returncode}): {r.stderr[-3000:]}"
    res = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert len(res) == 9
    for path, (h, w) in zip(paths, CLAIMS):
        want = f"record 1: the JPEG header says {W}x{H} (WxH) but the dataset index says {w}x{h}"
        for key in ("True-64", "True-224", "False-32"):
            got = res[f"{path} {key}"]
            assert got["skipped"] == got["epochs"], (path, key, got)  # record 1, once per epoch
            assert got["consistent"], (path, key, got)  # every slot a real image, in its own label's colour
            assert len(got["messages"]) == got["epochs"], (path, key, got["messages"])
            assert all(want in m for m in got["messages"]), (path, key, got["messages"])


def test_numba_decode_checks_the_header_before_touching_pixels(make_jpeg):
    from fastxfer.data.decoders.numba_ref import crop_resize_normalize, decode

    data = make_jpeg(H, W, seed=0)
    with pytest.raises(ValueError, match=r"the JPEG header says 60x40 \(WxH\) but the dataset index says 60x65535"):
        decode(data, 65535, W, (30000, 0, 5000, W), (64, 64))
    img, box = decode(data, H, W, (0, 0, H, W), (H, W))  # no DCT scaling: the whole 60x40 image
    assert img.shape == (H, W, 3) and box == (0, 0, H, W)
    with pytest.raises(ValueError, match=r"crop box \(y 30, x 0, h 20, w 60\) is not inside the 60x40"):
        crop_resize_normalize(img, 30, 0, 20, W, np.empty((16, 16, 3), np.float32), False, 1.0, 1.0, 1.0, MEAN, STD)


# ---- row 8: list-file labels -------------------------------------------------------------------

def test_list_file_labels_are_validated_naming_file_and_line(tmp_path, make_jpeg):
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(make_jpeg(H, W, seed=i))
    lst = tmp_path / "list.txt"
    cases = {
        "0.jpg 0\n# comment\n1.jpg -1\n": r"list\.txt:3: label -1 is not a class number \(0\.\.16777215\)",
        "0.jpg cat\n1.jpg dog\n2.jpg 0\n": r"list\.txt:3: label '0' is a class number but line 1 gave a class "
                                           r"name \('cat'\): a list file uses class numbers or class names, not both",
        "0.jpg 1\n1.jpg dog\n": r"list\.txt:2: label 'dog' is a class name but line 1 gave a class number \('1'\)",
        "0.jpg 2147483647\n": r"list\.txt:1: label 2147483647 is not a class number",
    }
    for text, message in cases.items():
        lst.write_text(text)
        with pytest.raises(FastxferError, match=message):
            read_list_file(str(lst))
    # the command says the same and writes nothing
    lst.write_text("0.jpg cat\n1.jpg dog\n2.jpg 0\n")
    r = run_command(fastxfer_cmd() + ["data", "pack", str(lst), str(tmp_path / "x.fxpack"), "--no-progress"],
                    timeout=120)
    assert r.returncode == 1 and "list.txt:3: label '0' is a class number" in r.stderr, r.stderr
    assert not (tmp_path / "x.fxpack").exists()
    # one numbering per file: names give classes in order of appearance, numbers give no names
    lst.write_text("0.jpg cat\n1.jpg dog\n2.jpg cat\n")
    assert read_list_file(str(lst)) == ([(str(tmp_path / f"{i}.jpg"), lab) for i, lab in enumerate((0, 1, 0))],
                                        ["cat", "dog"])
    # pack() refuses what a list file cannot express: a negative label, a label past the names
    items = [(str(tmp_path / "0.jpg"), 0), (str(tmp_path / "1.jpg"), -1)]
    with pytest.raises(FastxferError, match=r"item 1 \(.*1\.jpg\): label -1 is not an integer in 0\.\.16777215"):
        pack(items, str(tmp_path / "y.fxpack"), progress=False)
    with pytest.raises(FastxferError, match=r"item 1 .*: label 2 is not one of the 2 named classes in 0\.\.1"):
        pack([(str(tmp_path / "0.jpg"), 0), (str(tmp_path / "1.jpg"), 2)], str(tmp_path / "y.fxpack"),
             ["cat", "dog"], progress=False)
    assert not (tmp_path / "y.fxpack").exists()


def test_a_forged_negative_label_never_wraps_to_the_last_class(small_pack):
    path = small_pack()
    forge(path, 4, label=-1)
    with pytest.raises(PackedFormatError, match=r"index record 4: label -1 is not a class: the pack names 3 classes"):
        loader(path, batch_size=2, label_smoothing=0.1)


# ---- row 9: forged index fields and metadata ---------------------------------------------------

FORGED = [
    (dict(height=0), r"index record 2: height 0 is not a valid image size"),
    (dict(width=0), r"index record 2: width 0 is not a valid image size"),
    (dict(offset=2**63 + 4096), r"index record 2: offset 9223372036854779904 is outside the data region"),
    (dict(offset=2**64 - 1), r"index record 2: offset 18446744073709551615 is outside the data region"),
    (dict(size=2**32 - 1), r"index record 2: size 4294967295 at offset \d+ runs past the data region's end"),
    (dict(label=2**31 - 1), r"index record 2: label 2147483647 is not a class: the pack names 3 classes"),
    (dict(label=3), r"index record 2: label 3 is not a class: the pack names 3 classes \(labels 0\.\.2\)"),
]


@pytest.mark.parametrize("fields,message", FORGED, ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_forged_index_fields_are_named_on_open(small_pack, fields, message):
    path = small_pack()
    forge(path, 2, **fields)
    with pytest.raises(PackedFormatError, match=message):
        PackedDataset(str(path))
    for decoder in ("numba", "native"):  # the loader opens the pack first: no ZeroDivisionError, no 24 GiB
        with pytest.raises(PackedFormatError, match=message):
            loader(path, batch_size=4, train=True, mixup_alpha=0.2, decoder=decoder)


@pytest.mark.parametrize("meta,message", [
    (b"[1, 2]", r"the metadata is a JSON list, not an object"),
    (b'"classes"', r"the metadata is a JSON str, not an object"),
    (b"\xff{", r"the metadata is not valid JSON"),
    (b'{"classes": "red"}', r"the metadata field 'classes' is not a list of class names"),
    (b'{"classes": ["a", "b", "c"], "num_classes": 4}', r"field 'num_classes' is 4 but field 'classes' names 3"),
    (b'{"classes": [], "num_classes": 2}', r"index record 2: label 2 is not a class: the pack has 2 classes"),
    (b'{"classes": ["a", "b", "c"], "untiled": -1}', r"field 'untiled' is -1, not a non-negative integer"),
], ids=["list", "string", "not-json", "classes", "num-classes", "labels", "untiled"])
def test_forged_metadata_is_a_format_error_everywhere(small_pack, meta, message):
    path = small_pack()
    forge(path, meta=meta)
    with pytest.raises(PackedFormatError, match=message):
        PackedDataset(str(path))
    with pytest.raises(PackedFormatError, match=message):
        loader(path, batch_size=2)


def test_data_info_on_forged_metadata_says_what_is_wrong(small_pack):
    path = small_pack()
    forge(path, meta=b"[1, 2]")
    r = run_command(fastxfer_cmd() + ["data", "info", str(path)], timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"fastxfer data: {path}: the metadata is a JSON list, not an object" in r.stderr


def test_num_classes_below_a_label_is_named(small_pack):
    path = small_pack()
    with pytest.raises(PackedFormatError, match=r"index record 2: label 2 is not below num_classes=2"):
        loader(path, batch_size=4, mixup_alpha=0.2, num_classes=2)
    ld = loader(path, batch_size=4, label_smoothing=0.1, num_classes=10)  # more classes than the pack uses: fine
    assert ld.num_classes == 10 and ld.batch(0)[1].shape == (4, 10)
    ld.close()


# ---- row 13: a batch with no readable record ---------------------------------------------------

@pytest.mark.parametrize("decoder", ["numba", "native"])
def test_a_batch_with_no_readable_record_is_filled_counted_and_warned(small_pack, corrupt_record, decoder, caplog):
    path = small_pack()
    corrupt_record(path, 3)  # checksum mismatch
    forge(path, 4, height=H // 2)  # a header that disagrees with the index (CRCs recomputed)
    ld = loader(path, batch_size=1, image_size=16, train=False, decoder=decoder)
    assert len(ld) == 6
    caplog.clear()
    batches = list(ld)
    assert len(batches) == len(ld) == 6 and all(len(lab) == 1 for _, lab in batches)
    for images, labels in batches:  # the replacement images come with their own labels
        assert colour_of(images[0]) == labels[0]
    assert [int(lab[0]) for _, lab in batches] == [0, 1, 2, 2, 2, 2]  # records 3 and 4 -> record 5 (label 2)
    assert ld.skipped == 2 and ld.skipped_batches == 2
    messages = [r.getMessage() for r in caplog.records if r.name == "fastxfer" and r.levelname == "WARNING"]
    assert len(messages) == 2
    assert "skipped batch 3 of epoch 0: none of its 1 record(s) is readable (e.g. record 3:" in messages[0]
    assert "checksum mismatch" in messages[0] and "other records of this rank's epoch (5)" in messages[0]
    assert "skipped batch 4 of epoch 0" in messages[1] and "record 4: the JPEG header says 60x40" in messages[1]
    # train: the same holds with shuffling and drop_last; every epoch keeps len() batches
    ld = loader(path, batch_size=2, image_size=16, train=True, decoder=decoder)
    for epoch in range(3):
        ld.set_epoch(epoch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert sum(1 for _ in ld) == len(ld) == 3
    assert ld.skipped == 6
    ld.close()


@pytest.mark.parametrize("decoder", ["numba", "native"])
def test_a_pack_with_no_readable_record_is_a_clear_error(small_pack, corrupt_record, decoder):
    path = small_pack(n=3)
    for i in range(3):
        corrupt_record(path, i)
    ld = loader(path, batch_size=1, image_size=16, train=False, decoder=decoder)
    with pytest.raises(PackedFormatError, match=r"none of the 3 records this rank reads in epoch 0 is readable "
                                                r"\(e\.g\. record \d: .*checksum mismatch\)"):
        list(ld)
    assert ld.skipped == 0  # nothing was delivered
    ld.close()


# ---- row 14: pack counts every file it skips ----------------------------------------------------

def test_pack_counts_and_names_every_skipped_file(tmp_path, make_jpeg):
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "dog" / "nested").mkdir(parents=True)
    (src / "cat" / "a.jpg").write_bytes(make_jpeg(H, W, seed=0))
    (src / "dog" / "b.jpg").write_bytes(make_jpeg(H, W, seed=1))
    (src / "dog" / "nested" / "c.jpg").write_bytes(make_jpeg(H, W, seed=2))
    (src / "dog" / "notes.txt").write_text("not an image")
    os.mkfifo(src / "cat" / "fifo.jpg")
    os.symlink(tmp_path / "nowhere.jpg", src / "cat" / "dangling.jpg")
    os.symlink("loop.jpg", src / "dog" / "loop.jpg")
    os.symlink(tmp_path / "src" / "cat" / "a.jpg", src / "dog" / "link.jpg")  # a good link is followed
    expected = {
        str(src / "cat" / "dangling.jpg"): f"dangling symbolic link (to '{tmp_path / 'nowhere.jpg'}')",
        str(src / "cat" / "fifo.jpg"): "not a regular file: a FIFO",
        str(src / "dog" / "loop.jpg"): "symbolic link loop",
        str(src / "dog" / "nested"): "not a regular file: a folder (sub-folders are not searched)",
    }
    from fastxfer.data import scan_image_folder

    items, classes = scan_image_folder(str(src))
    summary = {}
    t = threading.Thread(target=lambda: summary.update(pack(items, str(tmp_path / "p.fxpack"), classes,
                                                            progress=False)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "pack blocked (on the FIFO?)"
    assert summary["records"] == 3
    skipped = dict(summary["skipped"])
    assert len(summary["skipped"]) == 5
    assert skipped.pop(str(src / "dog" / "notes.txt")).startswith("not a readable JPEG")
    assert skipped == expected
    with PackedDataset(str(tmp_path / "p.fxpack")) as ds:
        assert ds.meta["skipped"] == 5 and ds.labels.tolist() == [0, 1, 1]
    # the command lists each, with its reason; a list file naming a FIFO or a device is not read
    r = run_command(fastxfer_cmd() + ["data", "pack", str(src), str(tmp_path / "q.fxpack"), "--no-progress"],
                    timeout=120)
    assert r.returncode == 0 and "packed 3 images of 2 classes" in r.stdout, r.stderr
    assert "skipped 5 file(s):" in r.stderr
    for path, why in expected.items():
        assert f"  {path}: {why}\n" in r.stderr
    lst = tmp_path / "list.txt"
    lst.write_text(f"{src}/cat/a.jpg 0\n{src}/cat/fifo.jpg 1\n/dev/zero 1\n{src}/cat/dangling.jpg 0\n")
    r = run_command(fastxfer_cmd() + ["data", "pack", str(lst), str(tmp_path / "l.fxpack"), "--no-progress"],
                    timeout=120)
    assert r.returncode == 0 and "packed 1 images" in r.stdout, r.stderr
    assert "skipped 3 file(s):" in r.stderr and "/dev/zero: not a regular file: a character device" in r.stderr
    assert "fifo.jpg: not a regular file: a FIFO" in r.stderr and "dangling.jpg: dangling symbolic link" in r.stderr
    info = json.loads(run_command(fastxfer_cmd() + ["data", "info", str(tmp_path / "l.fxpack"), "--json"],
                                  timeout=120).stdout)
    assert info["skipped_when_packed"] == 3 and info["num_classes"] == 2
