"""Augmentation parameters, drawn with numpy for a whole batch at once: per image, a
counter-based hash of (seed, epoch, rank, record, draw) gives the random-resized-crop box, the
flip and the colour-jitter factors, so an image gets the same augmentation whatever batch it
falls in and whichever decoder runs; per batch, mixup and label smoothing."""

from __future__ import annotations

import math

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
DRAWS = 26  # uniforms per image: 10 crop tries x 2, crop position x 2, flip, 3 jitter factors


def _splitmix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def image_uniforms(seed: int, epoch: int, rank: int, indices, count: int = DRAWS) -> np.ndarray:
    """(len(indices), count) float64 uniforms in [0, 1), a counter-based hash of (seed, epoch, rank,
    index, draw): the same image gets the same draws whatever batch it lands in, and a batch costs
    a few vectorised numpy operations instead of one generator per image."""
    idx = np.asarray(indices, np.int64).astype(np.uint64).reshape(-1, 1)
    key = np.array([seed, epoch, rank], np.int64).astype(np.uint64)
    k = _splitmix(np.full(1, key[0]))
    k = _splitmix(k ^ key[1])
    k = _splitmix(k ^ key[2])
    k = _splitmix(k ^ idx)
    z = _splitmix(k + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_rrc(u: np.ndarray, heights, widths, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    """Random-resized-crop boxes (n, 4) int32 of (y, x, h, w), as torchvision samples them: area
    uniform in `scale`, log-aspect-ratio uniform in `ratio`, 10 tries, then the centre crop closest
    to `ratio`. u: (n, >= 22) uniforms (image_uniforms); columns 0-19 are the tries, 20-21 the
    position."""
    H = np.asarray(heights, np.float64)
    W = np.asarray(widths, np.float64)
    n = len(H)
    area = H * W
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    hs = np.zeros(n)
    ws = np.zeros(n)
    done = np.zeros(n, bool)
    for t in range(10):
        target = area * (scale[0] + (scale[1] - scale[0]) * u[:, 2 * t])
        ar = np.exp(log_lo + (log_hi - log_lo) * u[:, 2 * t + 1])
        w = np.rint(np.sqrt(target * ar))
        h = np.rint(np.sqrt(target / ar))
        ok = ~done & (w > 0) & (w <= W) & (h > 0) & (h <= H)
        hs[ok], ws[ok] = h[ok], w[ok]
        done |= ok
    boxes = np.empty((n, 4), np.int32)
    y = np.minimum(np.floor(u[:, 20] * (H - hs + 1)), H - hs)
    x = np.minimum(np.floor(u[:, 21] * (W - ws + 1)), W - ws)
    boxes[:] = np.stack([y, x, hs, ws], 1)
    for i in np.flatnonzero(~done):  # rare: fall back to the centre crop
        h, w = int(H[i]), int(W[i])
        in_ratio = w / h
        if in_ratio < ratio[0]:
            cw, ch = w, int(round(w / ratio[0]))
        elif in_ratio > ratio[1]:
            ch, cw = h, int(round(h * ratio[1]))
        else:
            cw, ch = w, h
        boxes[i] = ((h - ch) // 2, (w - cw) // 2, ch, cw)
    return boxes


def augment_params(u: np.ndarray, heights, widths, train: bool, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                   flip: bool = True, color_jitter=(0.0, 0.0, 0.0)):
    """(boxes (n, 4) int32, flips (n,) uint8, jitter (n, 3) float32 of brightness/contrast/saturation
    factors) for a batch; evaluation: centre crops, no flip, no jitter."""
    n = len(heights)
    jitter = np.ones((n, 3), np.float32)
    if not train:
        boxes = np.array([center_crop_box(int(h), int(w)) for h, w in zip(heights, widths)], np.int32).reshape(n, 4)
        return boxes, np.zeros(n, np.uint8), jitter
    boxes = sample_rrc(u, heights, widths, scale, ratio)
    flips = ((u[:, 22] < 0.5) & flip).astype(np.uint8)
    for c, j in enumerate(color_jitter):
        if j > 0:
            lo = max(0.0, 1 - j)
            jitter[:, c] = lo + (1 + j - lo) * u[:, 23 + c]
    return boxes, flips, jitter


def center_crop_box(height: int, width: int, fraction: float = 0.875):
    """Evaluation crop: the centred square of side fraction x the shorter side (224 of 256)."""
    side = max(1, int(round(min(height, width) * fraction)))
    return (height - side) // 2, (width - side) // 2, side, side




def mixup(images: np.ndarray, labels: np.ndarray, num_classes: int, alpha: float, smoothing: float,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Mixup (Zhang et al.) of a batch with its reverse permutation, lambda ~ Beta(alpha, alpha),
    on one-hot labels smoothed by `smoothing`. In place for the images; returns (images, targets)."""
    n = len(labels)
    onehot = np.full((n, num_classes), smoothing / num_classes, np.float32)
    onehot[np.arange(n), labels] += 1.0 - smoothing
    if alpha <= 0 or n < 2:
        return images, onehot
    lam = np.float32(rng.beta(alpha, alpha))
    perm = np.arange(n)[::-1]
    images[:] = lam * images + (1 - lam) * images[perm]
    return images, lam * onehot + (1 - lam) * onehot[perm]
