"""Augmentation sampling: the random-resized-crop rules, the counter-based per-image draws,
flip and colour jitter, mixup and label smoothing."""

import math

import numpy as np
import pytest

pytest.importorskip("numba")  # importing fastxfer.data loads the Numba reference decoder

from fastxfer.data import sampling as S  # noqa: E402


def test_rrc_sampling_rules():
    n = 4000
    u = S.image_uniforms(0, 0, 0, np.arange(n))
    boxes = S.sample_rrc(u, np.full(n, 375), np.full(n, 500))
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
    a = S.image_uniforms(5, 1, 0, [7, 8, 9])
    np.testing.assert_array_equal(a[0], S.image_uniforms(5, 1, 0, [7])[0])
    assert not np.array_equal(a[0], S.image_uniforms(5, 2, 0, [7])[0])
    assert not np.array_equal(a[0], S.image_uniforms(5, 1, 1, [7])[0])
    assert (a >= 0).all() and (a < 1).all()
    # a sliver image falls back to the centre crop with the closest allowed ratio
    box = S.sample_rrc(S.image_uniforms(0, 0, 0, [0]), [10], [1000], scale=(0.99, 1.0))
    assert tuple(box[0]) == (0, 493, 10, 13)
    assert S.center_crop_box(375, 500) == (23, 86, 328, 328)


def test_augment_params_flip_and_jitter():
    n = 2000
    u = S.image_uniforms(3, 0, 0, np.arange(n))
    boxes, flips, jitter = S.augment_params(u, np.full(n, 100), np.full(n, 120), True, color_jitter=(0.4, 0.0, 0.2))
    assert 0.45 < flips.mean() < 0.55 and set(np.unique(flips)) == {0, 1}
    assert (jitter[:, 0] >= 0.6).all() and (jitter[:, 0] <= 1.4).all() and jitter[:, 0].std() > 0.2
    assert (jitter[:, 1] == 1.0).all()
    assert (jitter[:, 2] >= 0.8).all() and (jitter[:, 2] <= 1.2).all()
    _, flips, _ = S.augment_params(u, np.full(n, 100), np.full(n, 120), True, flip=False)
    assert not flips.any()
    boxes, flips, jitter = S.augment_params(None, [375, 100], [500, 100], False)
    assert boxes.tolist() == [[23, 86, 328, 328], [6, 6, 88, 88]] and not flips.any() and (jitter == 1).all()


def test_mixup_and_label_smoothing():
    imgs = np.stack([np.full((2, 2, 3), v, np.float32) for v in (0, 1, 2, 3)])
    labels = np.array([0, 1, 2, 0])
    out, targets = S.mixup(imgs.copy(), labels, 3, alpha=0.0, smoothing=0.3, rng=np.random.default_rng(0))
    np.testing.assert_allclose(targets[0], [0.8, 0.1, 0.1])
    np.testing.assert_allclose(targets.sum(1), 1.0)
    out, targets = S.mixup(imgs.copy(), labels, 3, alpha=0.4, smoothing=0.0, rng=np.random.default_rng(1))
    # image i is lam * img[i] + (1 - lam) * img[n-1-i]: recover lam from image 0 (values 0 and 3)
    lam = 1 - out[0, 0, 0, 0] / 3
    np.testing.assert_allclose(out[1], lam * 1 + (1 - lam) * 2, rtol=1e-6)
    np.testing.assert_allclose(targets[1], lam * np.eye(3)[1] + (1 - lam) * np.eye(3)[2], rtol=1e-6)
    assert math.isclose(targets[0].sum(), 1.0, rel_tol=1e-6)
