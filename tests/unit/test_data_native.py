"""The native input pipeline: region-of-interest and tiled JPEG decoding (libjpeg-turbo from
Pillow's wheel) fused with the C++ resampler, checked against the simplejpeg + Numba reference,
across chroma subsampling, progressive files, threads and SIMD paths; the tiled format itself;
and the errors when the decoder cannot run."""

import re

import numpy as np
import pytest

simplejpeg = pytest.importorskip("simplejpeg")
pytest.importorskip("numba")
pytest.importorskip("PIL.Image")  # libjpeg-turbo comes from Pillow's wheel

from fastxfer import _core  # noqa: E402
from fastxfer.data import Loader, PackedDataset, pack  # noqa: E402
from fastxfer.data.decoders import numba_ref as K  # noqa: E402
from fastxfer.data.decoders.native import libjpeg_path, native_decoder_status  # noqa: E402

native_ok, native_why = native_decoder_status()
needs_native = pytest.mark.skipif(not native_ok, reason=f"native decoder unavailable: {native_why}")


KINDS = ["444", "420", "422", "progressive", "gray"]
SIZES = [(375, 500), (240, 180), (97, 131), (600, 800), (33, 47)]


@pytest.fixture(scope="module")
def packs(tmp_path_factory, make_jpeg):
    tmp = tmp_path_factory.mktemp("native")
    items = []
    for i in range(30):
        h, w = SIZES[i % len(SIZES)]
        p = tmp / f"{i}.jpg"
        p.write_bytes(make_jpeg(h, w, seed=i % 7, content="photo", kind=KINDS[i % len(KINDS)]))
        items.append((str(p), i % 5))
    tiled, plain = tmp / "tiled.fxpack", tmp / "plain.fxpack"
    s = pack(items, str(tiled), progress=False, tiles=True) if native_ok else None
    pack(items, str(plain), progress=False, tiles=False)
    return tiled, plain, s


def batches(path, **kw):
    ld = Loader(str(path), kw.pop("batch_size", 10), rank=0, size=1, **kw)
    try:
        return [ld.batch(b) for b in range(len(ld))]
    finally:
        ld.close()


@needs_native
def test_pack_tiles_every_kind_losslessly(packs):
    tiled, plain, summary = packs
    assert summary["untiled"] == [] and summary["records"] == 30
    with PackedDataset(str(tiled)) as t, PackedDataset(str(plain)) as p:
        for i in range(len(t)):
            a, b = bytes(t.record(i)), bytes(p.record(i))
            layout = _core.jpeg_tile_layout(a)
            assert layout is not None and _core.jpeg_tile_layout(b) is None
            kind = KINDS[i % len(KINDS)]
            assert (layout.mcu_h, layout.mcu_w) == {"444": (8, 8), "420": (16, 16), "422": (8, 16),
                                                          "progressive": (16, 16), "gray": (8, 8)}[kind]
            assert layout.subsampled == (kind in ("420", "422", "progressive"))
            cs = "GRAY" if kind == "gray" else "RGB"
            np.testing.assert_array_equal(simplejpeg.decode_jpeg(a, colorspace=cs),
                                          simplejpeg.decode_jpeg(b, colorspace=cs))


@needs_native
@pytest.mark.parametrize("train", [True, False])
def test_native_matches_the_numba_reference(packs, train):
    tiled, plain, _ = packs
    kw = dict(image_size=48, train=train, color_jitter=(0.3, 0.3, 0.3) if train else (0, 0, 0), seed=4)
    ref = batches(plain, decoder="numba", **kw)
    for path in (tiled, plain):
        got = batches(path, decoder="native", **kw)
        for (x, y), (rx, ry) in zip(got, ref):
            np.testing.assert_array_equal(y, ry)
            # the same pixels, the same filter; only float summation order differs
            np.testing.assert_allclose(x, rx, rtol=0, atol=2e-5)


@needs_native
def test_tiles_roi_and_threads_give_identical_bits(packs):
    tiled, plain, _ = packs
    kw = dict(image_size=40, train=True, seed=9)
    base = batches(tiled, decoder="native", threads=1, **kw)
    for path, threads, tiles in ((tiled, 2, True), (tiled, 1, False), (plain, 2, True)):
        ld = Loader(str(path), 10, rank=0, size=1, decoder="native", threads=threads, **kw)
        ld.native_decoder.set_tiles(tiles)
        for b, (x, y) in enumerate(base):
            bx, by = ld.batch(b)
            np.testing.assert_array_equal(bx, x)
            np.testing.assert_array_equal(by, y)
        ld.close()


@needs_native
def test_native_bf16_is_the_rounded_float32_batch(packs):
    from fastxfer import compress

    tiled, _, _ = packs
    f32 = batches(tiled, decoder="native", image_size=32, dtype="float32")
    b16 = batches(tiled, decoder="native", image_size=32, dtype="bfloat16")
    for (x, _), (h, _) in zip(f32, b16):
        assert h.dtype.name == "bfloat16"
        np.testing.assert_array_equal(h.view(np.uint16), compress(x, "bf16").view(np.uint16))


def test_tile_layout_refuses_everything_else(make_jpeg):
    plain = make_jpeg(64, 80, seed=1, content="photo", kind="420")
    assert _core.jpeg_tile_layout(plain) is None
    assert _core.jpeg_tile_layout(make_jpeg(64, 80, seed=1, content="photo", kind="progressive")) is None
    assert _core.jpeg_tile_layout(b"") is None and _core.jpeg_tile_layout(b"\xff\xd8") is None
    assert _core.jpeg_tile_layout(np.random.default_rng(0).bytes(5000)) is None
    with pytest.raises(ValueError, match="not a tiled JPEG"):
        _core.jpeg_tile_crop(plain, 0, 1, 0, 1)


@needs_native
def test_tile_crop_is_a_valid_jpeg_with_the_same_interior(make_jpeg):
    dec = _core.JpegBatchDecoder(libjpeg_path(), 1)
    for kind in ("444", "420"):
        data = make_jpeg(200, 260, seed=3, content="photo", kind=kind)
        t = dec.transcode(data)
        layout = _core.jpeg_tile_layout(t)
        m = layout.mcu_h
        full = simplejpeg.decode_jpeg(data)
        crop = simplejpeg.decode_jpeg(_core.jpeg_tile_crop(t, 2, 5, 3, 9))
        assert crop.shape == (3 * m, 6 * m, 3)
        # 4:4:4 cuts exactly; with subsampled chroma only the outermost pixels may differ
        edge = 0 if kind == "444" else m // 2
        np.testing.assert_array_equal(crop[edge:3 * m - edge, edge:6 * m - edge],
                                      full[2 * m + edge:5 * m - edge, 3 * m + edge:9 * m - edge])
        # the last row and column (partial MCUs) come out with the image's own size
        last = simplejpeg.decode_jpeg(_core.jpeg_tile_crop(t, layout.rows - 1, layout.rows, 0, layout.cols))
        assert last.shape == (200 - (layout.rows - 1) * m, 260, 3)
        with pytest.raises(ValueError, match="outside the"):
            _core.jpeg_tile_crop(t, 0, layout.rows + 1, 0, 1)
    # mutated tiled files: parsing never reads out of bounds or crashes
    rng = np.random.default_rng(5)
    for _ in range(300):
        b = bytearray(t)
        for _ in range(int(rng.integers(1, 8))):
            b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            b = b[: int(rng.integers(0, len(b)))]
        layout = _core.jpeg_tile_layout(bytes(b))
        assert layout is None or layout.rows * layout.cols > 0


@needs_native
def test_transcode_errors_and_damaged_files_kept_as_they_are(tmp_path, make_jpeg):
    dec = _core.JpegBatchDecoder(libjpeg_path(), 1)
    with pytest.raises(RuntimeError, match="Not a JPEG file"):
        dec.transcode(b"GIF89a....")
    good = make_jpeg(120, 160, seed=2, content="photo", kind="420")
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(good[: len(good) // 2])
    ok = tmp_path / "ok.jpg"
    ok.write_bytes(good)
    s = pack([(str(ok), 0), (str(cut), 1)], str(tmp_path / "p.fxpack"), progress=False)
    assert s["records"] == 2 and [p for p, _ in s["untiled"]] == [str(cut)]
    assert "Premature end" in s["untiled"][0][1] or "ended" in s["untiled"][0][1]
    with PackedDataset(str(tmp_path / "p.fxpack")) as ds:
        assert bytes(ds.record(1)) == good[: len(good) // 2] and ds.meta["untiled"] == 1


def test_resampler_simd_paths_agree_and_match_numba():
    rng = np.random.default_rng(11)
    mean, std = K.IMAGENET_MEAN, K.IMAGENET_STD
    cases = [((375, 500, 3), (10, 20, 300, 400), (224, 224), False, (1, 1, 1)),
             ((375, 500, 3), (0, 0, 100, 120), (224, 221), True, (1.2, 1, 1)),
             ((375, 500, 1), (5, 7, 360, 480), (37, 61), True, (0.8, 1.3, 0.7)),
             ((20, 30, 4), (3, 3, 1, 1), (5, 7), True, (1, 1, 1)),
             ((900, 40, 3), (0, 0, 900, 40), (16, 16), False, (1, 1, 1))]
    levels = [lv for lv in _core.supported_simd_levels() if lv in ("scalar", "avx512")]
    saved = _core.simd_level()
    try:
        for shape, box, (oh, ow), flip, jit in cases:
            img = rng.integers(0, 256, shape, dtype=np.uint8)
            outs = []
            for lv in levels:
                _core._set_simd_level(lv)
                out = np.zeros((oh, ow, 3), np.float32)
                _core.resize_normalize(img, *box, out, flip, *jit, mean, std)
                outs.append(out)
            for o in outs[1:]:  # AVX-512 fuses multiply-adds; the portable path rounds each step
                np.testing.assert_allclose(o, outs[0], rtol=0, atol=2e-6)
            ref = np.zeros((oh, ow, 3), np.float32)
            src = img[..., :3] if shape[2] == 4 else img
            K.crop_resize_normalize(np.ascontiguousarray(src), *box, ref, flip, *jit, mean, std)
            np.testing.assert_allclose(outs[0], ref, rtol=0, atol=2e-5)
    finally:
        _core._set_simd_level(saved)


def test_resampler_bf16_output_and_argument_errors():
    from fastxfer import compress

    img = np.random.default_rng(2).integers(0, 256, (50, 60, 3), dtype=np.uint8)
    mean, std = K.IMAGENET_MEAN, K.IMAGENET_STD
    f = np.zeros((24, 24, 3), np.float32)
    h = np.zeros((24, 24, 3), np.uint16)
    for jit in ((1, 1, 1), (1.1, 0.7, 1.4)):
        _core.resize_normalize(img, 2, 3, 40, 50, f, True, *jit, mean, std)
        _core.resize_normalize(img, 2, 3, 40, 50, h, True, *jit, mean, std)
        np.testing.assert_array_equal(h, compress(f, "bf16").view(np.uint16))
    with pytest.raises(TypeError, match="out must have dtype float32 or bfloat16, not float64"):
        _core.resize_normalize(img, 0, 0, 10, 10, np.zeros((4, 4, 3)), False, 1, 1, 1, mean, std)
    with pytest.raises(ValueError, match=r"crop box \(y0=45, x0=0, h=10, w=10\) is not inside the 50x60 image"):
        _core.resize_normalize(img, 45, 0, 10, 10, f, False, 1, 1, 1, mean, std)
    with pytest.raises(ValueError, match="C = 1, 3 or 4"):
        _core.resize_normalize(np.zeros((4, 4, 2), np.uint8), 0, 0, 2, 2, f, False, 1, 1, 1, mean, std)
    with pytest.raises(ValueError, match="std must be non-zero"):
        _core.resize_normalize(img, 0, 0, 10, 10, f, False, 1, 1, 1, mean, np.zeros(3, np.float32))


def test_decoder_unavailable_is_a_clear_error_or_a_warned_fallback(packs, tmp_path, monkeypatch, caplog):
    _, plain, _ = packs
    monkeypatch.setenv("FASTXFER_LIBJPEG", str(tmp_path / "no-such-libjpeg.so"))
    with pytest.raises(RuntimeError, match=r"native JPEG decoder is not available: .*no-such-libjpeg\.so.*"
                                           r"decoder='numba'"):
        Loader(str(plain), 4, rank=0, size=1, decoder="native")
    ld = Loader(str(plain), 4, rank=0, size=1)
    said = [r for r in caplog.records if r.name == "fastxfer" and r.levelname == "WARNING"]
    assert len(said) == 1 and "native JPEG decoder unavailable" in said[0].getMessage(), caplog.text
    assert ld.decoder == "numba" and ld.batch(0)[0].shape == (4, 224, 224, 3)
    ld.close()
    import ctypes.util

    libz = ctypes.util.find_library("z")
    if libz:
        with pytest.raises(RuntimeError, match="has no jpeg_std_error: it is not libjpeg-turbo"):
            _core.JpegBatchDecoder(libz, 1)
    with pytest.raises(ValueError, match="decoder must be 'auto', 'native' or 'numba'"):
        Loader(str(plain), 4, rank=0, size=1, decoder="turbo")


@needs_native
def test_images_over_the_pixel_limit_are_skipped_with_the_reason(packs, caplog):
    tiled, _, _ = packs
    ld = Loader(str(tiled), 10, rank=0, size=1, train=False, decoder="native", image_size=16,
                max_pixels=200 * 200)
    x, y = ld.batch(0)
    assert "over the limit of 40000" in caplog.text, caplog.text
    assert ld.skipped > 0 and np.isfinite(x).all()
    ld.close()
    caplog.clear()
    ld = Loader(str(tiled), 10, rank=0, size=1, train=False, decoder="native", image_size=16)
    ld.batch(0)
    assert ld.skipped == 0 and "skipped" not in caplog.text
    ld.close()


@needs_native
@pytest.mark.parametrize("tiled", [False, True])
def test_native_crops_are_exactly_the_full_decode(tiled, make_jpeg):
    """A crop resized to its own size is the identity filter: the decoded region must equal the
    same region of a whole-image decode, bit for bit, at every position (chroma upsampling at the
    crop's edges included), for every kind of JPEG, by region of interest and by tiles."""
    dec = _core.JpegBatchDecoder(libjpeg_path(), 1)
    mean, std = np.zeros(3, np.float32), np.full(3, 1 / 255, np.float32)
    rng = np.random.default_rng(0)
    for kind in KINDS:
        for H, W in ((97, 131), (96, 128), (160, 200)):
            data = make_jpeg(H, W, seed=2, content="photo", kind=kind)
            full = simplejpeg.decode_jpeg(data)
            if tiled:
                data = dec.transcode(data)
                assert _core.jpeg_tile_layout(data) is not None
            for _ in range(12):
                h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
                y, x = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
                out = np.zeros((1, h, w, 3), np.float32)
                err = dec.decode_batch([data], np.array([H], np.int32), np.array([W], np.int32),
                                       np.array([(y, x, h, w)], np.int32), np.zeros(1, np.uint8),
                                       np.ones((1, 3), np.float32), mean, std, out)
                assert err == [""]
                np.testing.assert_array_equal(out[0], full[y:y + h, x:x + w], err_msg=f"{kind} {(y, x, h, w)}")


@needs_native
def test_tiles_match_roi_when_dct_scaling_meets_sizes_not_divisible_by_the_scale(make_jpeg):
    """Grey and 4:4:4 records (no MCU margin) whose height/width are not multiples of the DCT
    scale: the tile cut must still cover the scaled box (it once came out a row short)."""
    dec = _core.JpegBatchDecoder(libjpeg_path(), 1)
    roi = _core.JpegBatchDecoder(libjpeg_path(), 1)
    roi.set_tiles(False)
    mean, std = np.zeros(3, np.float32), np.full(3, 1 / 255, np.float32)
    rng = np.random.default_rng(3)
    for kind, (H, W) in (("gray", (2001, 2048)), ("444", (1001, 1203)), ("420", (999, 1201))):
        data = dec.transcode(make_jpeg(H, W, seed=1, content="photo", kind=kind))
        hh, ww = min(1800, H), min(1800, W)
        boxes = [(0, 0, hh, ww), (H - hh, W - ww, hh, ww)]
        for _ in range(8):
            h, w = int(rng.integers(450, H + 1)), int(rng.integers(450, W + 1))
            boxes.append((int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w))
        for out_hw in (224, 100, 48):
            for box in boxes:
                outs = []
                for d in (dec, roi):
                    o = np.zeros((1, out_hw, out_hw, 3), np.float32)
                    err = d.decode_batch([data], np.array([H], np.int32), np.array([W], np.int32),
                                         np.array([box], np.int32), np.zeros(1, np.uint8), np.ones((1, 3), np.float32),
                                         mean, std, o)
                    assert err == [""], (kind, box, out_hw, err)
                    outs.append(o)
                np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"{kind} {box} {out_hw}")


def test_bad_buffers_and_boxes_are_refused(make_jpeg):
    mean, std = K.IMAGENET_MEAN, K.IMAGENET_STD
    img = np.zeros((50, 60, 3), np.uint8)
    out = np.zeros((8, 8, 3), np.float32)
    with pytest.raises(ValueError, match="is not inside the 50x60 image"):
        _core.resize_normalize(img, 2**31 - 1, 0, 1, 1, out, False, 1, 1, 1, mean, std)
    with pytest.raises(ValueError, match="is not inside the 50x60 image"):
        _core.resize_normalize(img, 0, 2**31 - 5, 1, 10, out, False, 1, 1, 1, mean, std)
    data = make_jpeg(32, 32, seed=0, content="photo")
    with pytest.raises(ValueError, match="data is not contiguous"):
        _core.jpeg_tile_layout(memoryview(data)[::2])
    with pytest.raises(TypeError, match="data is a str, not bytes-like"):
        _core.jpeg_tile_layout("not bytes")
    # a forged frame size (65535 x 65535, restart interval 1) in a few bytes: refused at once
    sof = bytes([0xFF, 0xC0, 0, 17, 8, 0xFF, 0xFF, 0xFF, 0xFF, 3, 1, 0x11, 0, 2, 0x11, 0, 3, 0x11, 0])
    sos = bytes([0xFF, 0xDA, 0, 12, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0])
    forged = b"\xff\xd8" + b"\xff\xdd\x00\x04\x00\x01" + sof + sos + b"\x00" * 64 + b"\xff\xd9"
    assert _core.jpeg_tile_layout(forged) is None


@needs_native
def test_large_transcode_grows_its_buffer_and_keeps_pixels(make_jpeg):
    data = make_jpeg(700, 900, seed=4, quality=97)
    assert len(data) > 1 << 20
    dec = _core.JpegBatchDecoder(libjpeg_path(), 1)
    t = dec.transcode(data)
    assert len(t) > 1 << 20 and _core.jpeg_tile_layout(t) is not None  # grew well past its first 64 KiB
    np.testing.assert_array_equal(simplejpeg.decode_jpeg(t), simplejpeg.decode_jpeg(data))
    assert dec.transcode(data) == t  # the reused buffer gives the same bytes again


@needs_native
def test_cached_records_are_checksummed_too(tmp_path, make_jpeg, corrupt_record, caplog):
    items = []
    for i in range(6):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(make_jpeg(40, 50, seed=i, content="photo", kind="420"))
        items.append((str(p), i % 2))
    out = tmp_path / "c.fxpack"
    pack(items, str(out), progress=False)
    corrupt_record(out, 4, at=30)
    ld = Loader(str(out), 6, rank=0, size=1, train=False, cache=True, image_size=16)
    caplog.clear()
    ld.batch(0)
    assert re.search(r"skipped 1 unreadable record.*record 4.*checksum mismatch", caplog.text), caplog.text
    assert ld.skipped == 1
    ld.close()


@pytest.mark.parametrize("decoder", ["native", "numba"])
def test_a_loader_keeps_working_in_a_forked_child(packs, decoder):
    import os
    import signal
    import time

    if decoder == "native" and not native_ok:
        pytest.skip(native_why)
    _, plain, _ = packs
    ld = Loader(str(plain), 6, rank=0, size=1, train=False, image_size=16, decoder=decoder, threads=2)
    want, _ = ld.batch(1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: threads are gone; the loader must start its own
        import faulthandler

        faulthandler.dump_traceback_later(120, exit=True)  # never hang the test run
        code = 1
        try:
            got, _ = ld.batch(1)
            code = 0 if np.array_equal(got, want) else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 180  # the child stops itself after 120 s; this bounds the rest
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    status = os.read(r, 1)
    os.close(r)
    assert status == b"\x00"  # empty: the child died before it could answer
    np.testing.assert_array_equal(ld.batch(1)[0], want)  # and the parent's still works
    ld.close()
