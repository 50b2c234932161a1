"""The Numba reference kernel: resampling against a float64 reference, flip, colour,
normalisation, JIT vs plain Python."""

import numpy as np
import pytest

pytest.importorskip("numba")

from fastxfer.data.decoders import numba_ref as K  # noqa: E402

MEAN = np.zeros(3, np.float32)
STD = np.ones(3, np.float32) / 255  # (v/255 - 0) / (1/255) = v: outputs in pixel units


def reference_resize(img, y0, x0, ch, cw, oh, ow):
    """float64 separable triangle filter, written independently (loops over outputs)."""
    def weights(start, length, n_out):
        scale = length / n_out
        fs = max(scale, 1.0)
        rows = []
        for o in range(n_out):
            c = start + (o + 0.5) * scale
            lo = max(int(c - fs + 0.5), start)
            hi = min(int(c + fs + 0.5), start + length)
            ws = np.array([max(0.0, 1 - abs((i - c + 0.5) / fs)) for i in range(lo, hi)])
            rows.append((lo, ws / ws.sum()))
        return rows
    src = img.astype(np.float64)
    if src.shape[2] == 1:
        src = np.repeat(src, 3, axis=2)
    out = np.zeros((oh, ow, 3))
    wy, wx = weights(y0, ch, oh), weights(x0, cw, ow)
    for o, (ly, wsy) in enumerate(wy):
        rows = (src[ly:ly + len(wsy)] * wsy[:, None, None]).sum(0)
        for p, (lx, wsx) in enumerate(wx):
            out[o, p] = (rows[lx:lx + len(wsx)] * wsx[:, None]).sum(0)
    return out


def run_kernel(img, box, oh, ow, flip=False, b=1.0, c=1.0, s=1.0, py=False):
    out = np.zeros((oh, ow, 3), np.float32)
    f = K.crop_resize_normalize.py_func if py else K.crop_resize_normalize
    f(img, *box, out, flip, b, c, s, MEAN, STD)
    return out


@pytest.mark.parametrize("box,oh,ow", [((0, 0, 40, 60), 40, 60), ((5, 7, 30, 20), 60, 45), ((0, 0, 97, 131), 24, 24),
                                       ((10, 3, 80, 50), 7, 33)])
def test_resize_matches_float64_reference(box, oh, ow):
    img = np.random.default_rng(0).integers(0, 256, (100, 140, 3), dtype=np.uint8)
    got = run_kernel(img, box, oh, ow)
    want = reference_resize(img, *box, oh, ow)
    assert np.max(np.abs(got - want)) < 2e-3  # float32 accumulation against float64


def test_identity_constant_and_flip():
    img = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    same = run_kernel(img, (0, 0, 20, 30), 20, 30)
    np.testing.assert_allclose(same, img.astype(np.float32), atol=1e-4)  # no resampling when sizes match
    flipped = run_kernel(img, (0, 0, 20, 30), 20, 30, flip=True)
    np.testing.assert_allclose(flipped, img[:, ::-1].astype(np.float32), atol=1e-4)
    const = np.full((50, 50, 3), 77, np.uint8)
    np.testing.assert_allclose(run_kernel(const, (3, 4, 40, 41), 9, 13), 77, atol=1e-3)


def test_gray_is_replicated_and_colour_ops():
    gray = np.random.default_rng(2).integers(0, 256, (16, 16, 1), dtype=np.uint8)
    out = run_kernel(gray, (0, 0, 16, 16), 16, 16)
    np.testing.assert_allclose(out[..., 0], gray[..., 0], atol=1e-4)
    np.testing.assert_allclose(out[..., 0], out[..., 2], atol=0)
    img = np.full((8, 8, 3), 100, np.uint8)
    np.testing.assert_allclose(run_kernel(img, (0, 0, 8, 8), 8, 8, b=1.5), 150, atol=1e-3)
    np.testing.assert_allclose(run_kernel(img, (0, 0, 8, 8), 8, 8, b=3.0), 255, atol=1e-3)  # clamped
    two = np.zeros((2, 2, 3), np.uint8)
    two[0] = 200
    out = run_kernel(two, (0, 0, 2, 2), 2, 2, c=0.0)  # zero contrast: every pixel at the mean grey
    np.testing.assert_allclose(out, 100, atol=1e-3)
    col = np.zeros((2, 2, 3), np.uint8)
    col[..., 0] = 200
    out = run_kernel(col, (0, 0, 2, 2), 2, 2, s=0.0)  # zero saturation: grey 0.299*200
    np.testing.assert_allclose(out, 0.299 * 200, atol=1e-3)


def test_normalisation():
    img = np.full((4, 4, 3), 255, np.uint8)
    out = np.zeros((4, 4, 3), np.float32)
    K.crop_resize_normalize(img, 0, 0, 4, 4, out, False, 1.0, 1.0, 1.0, K.IMAGENET_MEAN, K.IMAGENET_STD)
    np.testing.assert_allclose(out[0, 0], (1 - K.IMAGENET_MEAN) / K.IMAGENET_STD, rtol=1e-6)


def test_jit_matches_plain_python():
    img = np.random.default_rng(3).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    a = run_kernel(img, (2, 5, 30, 41), 17, 19, flip=True, b=1.1, c=0.9, s=1.2)
    b = run_kernel(img, (2, 5, 30, 41), 17, 19, flip=True, b=1.1, c=0.9, s=1.2, py=True)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
