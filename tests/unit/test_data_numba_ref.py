"""Input-pipeline kernels: sampling rules, resampling against a float64 reference, flip, colour,
normalisation, JIT vs plain Python, mixup."""

import math

import numpy as np
import pytest

pytest.importorskip("numba")

from fastxfer.data import kernels as K  # noqa: E402

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


def test_rrc_sampling_rules():
    n = 4000
    u = K.image_uniforms(0, 0, 0, np.arange(n))
    boxes = K.sample_rrc(u, np.full(n, 375), np.full(n, 500))
    y, x, h, w = boxes.T
    assert boxes.dtype == np.int32
    assert (y >= 0).all() and (y + h <= 375).all() and (x >= 0).all() and (x + w <= 500).all()
    assert (h > 0).all() and (w > 0).all()
    areas, ratios = h * w / (375 * 500), w / h
    # uniform area in [0.08, 1], minus the large crops whose ratio does not fit (rejected): mean ~0.43
    assert 0.07 < areas.min() and areas.max() <= 1.0 and 0.38 < areas.mean() < 0.5
    assert ratios.min() > 0.7 and ratios.max() < 1.4
    # positions cover the free range uniformly: both extremes are reached
    assert (y == 0).any() and (x == 0).any() and (y + h == 375).any() and (x + w == 500).any()
    # the first try that fits wins, exactly as torchvision's loop: recompute try by try
    for i in range(200):
        for t in range(10):
            target = 375 * 500 * (0.08 + 0.92 * u[i, 2 * t])
            ar = np.exp(np.log(3 / 4) + (np.log(4 / 3) - np.log(3 / 4)) * u[i, 2 * t + 1])
            ww, hh = round(np.sqrt(target * ar)), round(np.sqrt(target / ar))
            if 0 < ww <= 500 and 0 < hh <= 375:
                assert (h[i], w[i]) == (hh, ww)
                assert y[i] == int(u[i, 20] * (375 - hh + 1)) and x[i] == int(u[i, 21] * (500 - ww + 1))
                break
    # deterministic per (seed, epoch, rank, index) whatever batch the image is in; epochs differ
    a = K.image_uniforms(5, 1, 0, [7, 8, 9])
    np.testing.assert_array_equal(a[0], K.image_uniforms(5, 1, 0, [7])[0])
    assert not np.array_equal(a[0], K.image_uniforms(5, 2, 0, [7])[0])
    assert not np.array_equal(a[0], K.image_uniforms(5, 1, 1, [7])[0])
    assert (a >= 0).all() and (a < 1).all()
    # a sliver image falls back to the centre crop with the closest allowed ratio
    box = K.sample_rrc(K.image_uniforms(0, 0, 0, [0]), [10], [1000], scale=(0.99, 1.0))
    assert tuple(box[0]) == (0, 493, 10, 13)
    assert K.center_crop_box(375, 500) == (23, 86, 328, 328)


def test_augment_params_flip_and_jitter():
    n = 2000
    u = K.image_uniforms(3, 0, 0, np.arange(n))
    boxes, flips, jitter = K.augment_params(u, np.full(n, 100), np.full(n, 120), True, color_jitter=(0.4, 0.0, 0.2))
    assert 0.45 < flips.mean() < 0.55 and set(np.unique(flips)) == {0, 1}
    assert (jitter[:, 0] >= 0.6).all() and (jitter[:, 0] <= 1.4).all() and jitter[:, 0].std() > 0.2
    assert (jitter[:, 1] == 1.0).all()
    assert (jitter[:, 2] >= 0.8).all() and (jitter[:, 2] <= 1.2).all()
    _, flips, _ = K.augment_params(u, np.full(n, 100), np.full(n, 120), True, flip=False)
    assert not flips.any()
    boxes, flips, jitter = K.augment_params(None, [375, 100], [500, 100], False)
    assert boxes.tolist() == [[23, 86, 328, 328], [6, 6, 88, 88]] and not flips.any() and (jitter == 1).all()


def test_mixup_and_label_smoothing():
    imgs = np.stack([np.full((2, 2, 3), v, np.float32) for v in (0, 1, 2, 3)])
    labels = np.array([0, 1, 2, 0])
    out, targets = K.mixup(imgs.copy(), labels, 3, alpha=0.0, smoothing=0.3, rng=np.random.default_rng(0))
    np.testing.assert_allclose(targets[0], [0.8, 0.1, 0.1])
    np.testing.assert_allclose(targets.sum(1), 1.0)
    out, targets = K.mixup(imgs.copy(), labels, 3, alpha=0.4, smoothing=0.0, rng=np.random.default_rng(1))
    # image i is lam * img[i] + (1 - lam) * img[n-1-i]: recover lam from image 0 (values 0 and 3)
    lam = 1 - out[0, 0, 0, 0] / 3
    np.testing.assert_allclose(out[1], lam * 1 + (1 - lam) * 2, rtol=1e-6)
    np.testing.assert_allclose(targets[1], lam * np.eye(3)[1] + (1 - lam) * np.eye(3)[2], rtol=1e-6)
    assert math.isclose(targets[0].sum(), 1.0, rel_tol=1e-6)
