"""The per-rank loader on real JPEGs: labels stay with their images (each class has its own
colour), sharding, determinism, DCT-scaled decode, bad records, grayscale/CMYK, adapters, fuzz.
The behaviour tests run with both decoders (native C++ and simplejpeg + Numba) and, where the
stored bytes matter, on tiled and byte-for-byte packs."""

import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

simplejpeg = pytest.importorskip("simplejpeg")
pytest.importorskip("numba")

from fastxfer.data import Loader, pack  # noqa: E402
from fastxfer.data.decoders.numba_ref import decode  # noqa: E402

COLORS = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200], [200, 200, 30]], np.uint8)
MEAN = np.zeros(3, np.float32)
STD = np.full(3, 1 / 255, np.float32)  # outputs in pixel units


@pytest.fixture(params=["native", "numba"])
def decoder(request):
    return request.param


@pytest.fixture
def build(tmp_path, make_jpeg):
    """build(n=40, sizes=..., extra=(), tiles=True) -> a pack of n images, each of its class's colour."""
    def build(n=40, sizes=((60, 80), (120, 90), (300, 400)), extra=(), tiles=True):
        rng = np.random.default_rng(0)
        items = []
        for i in range(n):
            label = i % len(COLORS)
            h, w = sizes[i % len(sizes)]
            p = tmp_path / f"{i}.jpg"
            p.write_bytes(make_jpeg(h, w, seed=rng, color=COLORS[label], quality=95))
            items.append((str(p), label))
        for p, label in extra:
            items.append((p, label))
        out = tmp_path / "d.fxpack"
        pack(items, str(out), [f"c{k}" for k in range(len(COLORS))], progress=False, tiles=tiles)
        return out
    return build


def label_of(image):
    """Which class colour an output image is (nearest mean colour)."""
    m = image.reshape(-1, 3).mean(0)
    return int(np.argmin(((COLORS.astype(np.float32) - m) ** 2).sum(1)))


def loader(path, **kw):
    kw.setdefault("rank", 0)
    kw.setdefault("size", 1)
    kw.setdefault("threads", 2)
    return Loader(str(path), mean=MEAN, std=STD, **kw)


def test_labels_follow_their_images_train_and_eval(build, decoder):
    path = build()
    for train in (True, False):
        ld = loader(path, batch_size=8, image_size=32, train=train, color_jitter=(0.2, 0.2, 0.2) if train else (0, 0, 0),
                    decoder=decoder)
        assert ld.decoder == decoder
        n = 0
        for images, labels in ld:
            assert images.shape[1:] == (32, 32, 3) and images.dtype == np.float32 and labels.dtype == np.int32
            assert [label_of(im) for im in images] == labels.tolist()
            n += len(labels)
        assert n == (40 if not train else 40 // 8 * 8)
        ld.close()


def test_sharding_disjoint_equal_and_reshuffled(build):
    path = build(n=41)
    a = loader(path, batch_size=4, image_size=16, rank=0, size=2)
    b = loader(path, batch_size=4, image_size=16, rank=1, size=2)
    ia, ib = a.indices(), b.indices()
    assert len(ia) == len(ib) == 20 and not set(ia) & set(ib)
    assert len(a) == len(b) == 5
    a.set_epoch(1)
    assert a.indices().tolist() != ia.tolist()
    again = loader(path, batch_size=4, image_size=16, rank=0, size=2)
    third = loader(path, batch_size=4, image_size=16, rank=0, size=2)
    np.testing.assert_array_equal(again.indices(), ia)
    x1, y1 = again.batch(2)
    x2, y2 = third.batch(2)
    np.testing.assert_array_equal(x1, x2)  # same seed, epoch, rank: the same augmentations
    np.testing.assert_array_equal(y1, y2)
    for ld in (a, b, again, third):
        ld.close()


def test_resume_reshards_the_rest_of_the_epoch_nothing_lost_or_repeated(build):
    """3 ranks train 3 steps of epoch 1, then the group shrinks to 2: the rest of the epoch's order
    is dealt to the 2 ranks; with the 3 ranks' first steps it covers the epoch once (only the tail
    that does not fill a batch on every rank is left out, as in any epoch)."""
    path = build(n=61)
    three = [loader(path, batch_size=4, image_size=8, rank=r, size=3, seed=5) for r in range(3)]
    for ld in three:
        ld.set_epoch(1)
    done = [int(i) for ld in three for i in ld.indices()[:3 * 4]]  # 3 steps of every rank
    assert three[0].global_batch == 12
    perm = np.random.default_rng(np.random.SeedSequence([5, 1])).permutation(61)
    assert sorted(done) == sorted(perm[:36].tolist())  # the steps done are a prefix of the epoch's order
    two = [loader(path, batch_size=4, image_size=8, rank=0, size=1, seed=5) for _ in range(2)]
    for r, ld in enumerate(two):
        ld.resume(1, start=3 * 12, rank=r, size=2)
        assert (ld.epoch, ld.start, ld.rank, ld.size, ld.global_batch) == (1, 36, r, 2, 8)
    rest = [int(i) for ld in two for i in ld.indices()]
    assert len(two[0]) == len(two[1]) == 3  # 12 records each: 3 batches of 4
    assert not set(rest) & set(done) and len(set(rest)) == len(rest) == 24
    assert sorted(done + rest) == sorted(perm[:60].tolist())  # one record of the 25 left is the odd tail
    labels = [int(y) for ld in two for _, ys in ld for y in ys]
    assert sorted(labels) == sorted(int(i) % 4 for i in rest)  # the batches hold exactly those records
    two[0].set_epoch(2)
    assert two[0].start == 0 and len(two[0]) == 61 // 2 // 4
    with pytest.raises(ValueError, match="start 62 is outside 0..61"):
        two[0].resume(1, start=62)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        two[0].resume(1, rank=2, size=2)
    for ld in three + two:
        ld.close()


def test_dct_scaled_decode_only_as_much_as_needed():
    img = np.zeros((1200, 1600, 3), np.uint8)
    data = simplejpeg.encode_jpeg(img, quality=80)
    full, box = decode(data, 1200, 1600, (0, 0, 1200, 1600), (64, 64))
    assert full.shape[:2] == (150, 200) and box == (0, 0, 150, 200)  # 1/8: still >= 64 px
    half, box = decode(data, 1200, 1600, (100, 200, 300, 300), (128, 128))
    assert half.shape[:2] == (600, 800) and box == (50, 100, 150, 150)  # 1/2: 150 >= 128
    same, box = decode(data, 1200, 1600, (0, 0, 200, 200), (150, 150))
    assert same.shape[:2] == (1200, 1600) and box == (0, 0, 200, 200)


@pytest.mark.parametrize("tiles", [True, False])
def test_bad_records_are_skipped_counted_and_labels_stay_right(tmp_path, build, make_jpeg, corrupt_record, decoder,
                                                               tiles, caplog):
    good = make_jpeg(200, 200, seed=1, quality=95)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(good[: len(good) // 2])  # header fine, body cut: decoding fails
    path = build(n=16, extra=[(str(broken), 2)], tiles=tiles)
    corrupt_record(path, 5, at=200)  # its checksum no longer matches
    ld = loader(path, batch_size=17, image_size=24, train=False, decoder=decoder)
    images, labels = ld.batch(0)
    assert "skipped 2 unreadable record" in caplog.text, caplog.text  # the fastxfer logger says so
    assert ld.skipped == 2 and len(labels) == 17
    assert [label_of(im) for im in images] == labels.tolist()
    ld.close()


@pytest.mark.parametrize("tiles", [True, False])
def test_grayscale_and_cmyk(tmp_path, decoder, tiles):
    gray = np.full((40, 40, 1), 120, np.uint8)
    (tmp_path / "g.jpg").write_bytes(simplejpeg.encode_jpeg(gray, quality=95, colorspace="GRAY"))
    cmyk = np.zeros((40, 40, 4), np.uint8)
    cmyk[..., 0] = 255  # (inverted Adobe CMYK) C = 255 -> R = C*K/255 = 255
    cmyk[..., 3] = 255
    (tmp_path / "c.jpg").write_bytes(simplejpeg.encode_jpeg(cmyk, quality=95, colorspace="CMYK"))
    out = tmp_path / "gc.fxpack"
    pack([(str(tmp_path / "g.jpg"), 0), (str(tmp_path / "c.jpg"), 1)], str(out), progress=False, tiles=tiles)
    ld = loader(out, batch_size=2, image_size=8, train=False, decoder=decoder)
    images, _ = ld.batch(0)
    np.testing.assert_allclose(images[0], 120, atol=2)
    assert abs(images[1][..., 0].mean() - 255) < 3 and images[1][..., 1].mean() < 3
    ld.close()


def test_mixup_bf16_and_early_stop(build, decoder):
    path = build()
    ld = loader(path, batch_size=8, image_size=16, mixup_alpha=0.4, label_smoothing=0.1, dtype="bfloat16",
                decoder=decoder)
    it = iter(ld)
    images, targets = next(it)
    assert images.dtype.name == "bfloat16" and targets.shape == (8, 4)
    np.testing.assert_allclose(targets.sum(1), 1.0, rtol=1e-5)
    # stopping early does not hang the prefetch thread (in a thread of ours, so a hang fails the test)
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "closing the batch iterator early hung"
    ld.close()
    with pytest.raises(ValueError, match="dtype must be"):
        Loader(str(path), 4, dtype="float16", rank=0, size=1)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        Loader(str(path), 4, rank=2, size=2)


@pytest.mark.parametrize("tiles", [True, False])
def test_fuzzed_jpegs_never_crash_the_loader(tmp_path, make_jpeg, decoder, tiles):
    rng = np.random.default_rng(7)
    items = []
    for i in range(120):
        label = i % len(COLORS)
        data = bytearray(make_jpeg(40 + i % 30, 50, seed=rng, color=COLORS[label], quality=95))
        for _ in range(int(rng.integers(0, 6))):
            data[int(rng.integers(2, len(data)))] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            data = data[: int(rng.integers(10, len(data)))]
        p = tmp_path / f"f{i}.jpg"
        p.write_bytes(bytes(data))
        items.append((str(p), label))
    out = tmp_path / "fuzz.fxpack"
    pack(items, str(out), progress=False, tiles=tiles)  # files without a readable header are skipped here
    ld = loader(out, batch_size=10, image_size=16, train=True, decoder=decoder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for images, labels in ld:
            assert np.isfinite(images).all() and len(labels) == 10
    ld.close()


ADAPTERS = r"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
from fastxfer.data import Loader
ld = Loader(sys.argv[1], 4, image_size=16, rank=0, size=1, threads=1)
ds = ld.as_tf_dataset()
x, y = next(iter(ds))
print("TF", tuple(x.shape), x.dtype.name, tuple(y.shape))
k = ld.as_keras()
xb, yb = k[1]
print("KERAS", len(k), xb.shape, yb.shape)
"""


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorflow") is None, reason="TensorFlow not installed")
def test_tf_and_keras_adapters(build):
    path = build()
    r = subprocess.run([sys.executable, "-c", ADAPTERS, str(path)], capture_output=True, text=True, timeout=300,
                       cwd="/", env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TF (4, 16, 16, 3) float32 (4,)" in r.stdout
    assert "KERAS 10 (4, 16, 16, 3) (4,)" in r.stdout


NO_NUMBA = """
import sys
sys.modules["numba"] = None  # `import numba` now raises ImportError, as on a machine without it
import numpy as np
from fastxfer.data import Loader, pack
from fastxfer.cli import build_parser
build_parser()  # the `fastxfer` command builds every subcommand, `data` included
ld = Loader(sys.argv[1], batch_size=4, image_size=32, decoder="native", rank=0, size=1)
images, labels = next(iter(ld))
assert images.shape == (4, 32, 32, 3) and ld.decoder == "native", (images.shape, ld.decoder)
print("native path ran without numba")
try:
    Loader(sys.argv[1], batch_size=4, image_size=32, decoder="numba", rank=0, size=1)
except RuntimeError as e:
    print("numba path:", e)
"""


def test_package_cli_and_native_loader_work_without_numba(build):
    """The main job installs the `examples` extra, which has no Numba: importing fastxfer.data (the
    `fastxfer` command does) must not need it, and asking for the Numba decoder says what to install."""
    r = subprocess.run([sys.executable, "-c", NO_NUMBA, str(build(8))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "native path ran without numba" in r.stdout
    assert "pip install 'fastxfer[data]'" in r.stdout
