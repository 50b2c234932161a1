"""Numba kernels of the input pipeline: random-resized-crop sampling, crop + resize (bilinear,
antialiased when shrinking) + flip + colour jitter + normalisation written straight into a
batch slot, and the evaluation centre crop.

Parameters are sampled with numpy (``sample_*``) from a per-image generator derived from
(seed, epoch, rank, index), so a batch is reproducible; the per-image kernel only applies them.
Kernels are ``njit(nogil=True, cache=True)``: loader threads run them in parallel, off the GIL.
``FASTXFER_NO_JIT=1`` runs the same code as plain Python (for debugging); every kernel also has
``.py_func`` and the tests compare the two.
"""

from __future__ import annotations

import math
import os

import numpy as np

NO_JIT = os.environ.get("FASTXFER_NO_JIT", "") not in ("", "0")

if NO_JIT:
    def njit(*args, **kwargs):
        def wrap(f):
            f.py_func = f
            return f
        return wrap(args[0]) if args and callable(args[0]) else wrap
else:
    from numba import njit  # noqa: F401  (one place for the Numba options: below)

_OPTS = dict(nogil=True, cache=True, fastmath=False, error_model="numpy")

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


# ---- parameter sampling (numpy, a whole batch at once; deterministic per image) ------------------

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


# ---- resampling --------------------------------------------------------------------------------

@njit(**_OPTS)
def _weights(start, length, out_len):
    """Separable bilinear (triangle) weights from input span [start, start+length) to out_len
    samples; the filter widens with the shrink factor (antialiasing), as PIL's BILINEAR does."""
    scale = length / out_len
    fscale = max(scale, 1.0)
    support = fscale  # triangle filter support 1, stretched when shrinking
    kmax = int(math.ceil(support)) * 2 + 1
    first = np.empty(out_len, np.int32)
    count = np.empty(out_len, np.int32)
    w = np.zeros((out_len, kmax), np.float32)
    for o in range(out_len):
        center = (o + 0.5) * scale  # relative to start: the weights do not depend on the crop's position
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), length)
        n = hi - lo
        total = 0.0
        for k in range(n):
            t = (lo + k - center + 0.5) / fscale
            v = 1.0 - abs(t)
            if v < 0.0:
                v = 0.0
            w[o, k] = v
            total += v
        if total > 0.0:
            for k in range(n):
                w[o, k] /= total
        first[o] = start + lo
        count[o] = n
    return first, count, w


@njit(**_OPTS)
def crop_resize_normalize_scratch(img, y0, x0, ch, cw, out, flip, brightness, contrast, saturation, mean, std,
                                  scratch):
    """img: uint8 HxWxC (C = 1 or 3); out: float32 oh x ow x 3 (a batch slot); scratch: float32,
    at least ch * ow * 3 elements (reused across calls: no allocation per image). Crops
    [y0, y0+ch) x [x0, x0+cw), resizes, flips horizontally if `flip`, applies brightness /
    contrast / saturation factors (1 = unchanged; in 0..255 space, clamped), then writes
    (v/255 - mean) / std. Grayscale input is replicated to 3 channels.

    Loop order is chosen so the innermost loops run over output columns (horizontal pass: a
    gather per tap) or over whole contiguous rows (vertical pass), which LLVM vectorises."""
    oh, ow = out.shape[0], out.shape[1]
    chans = img.shape[2]
    fy, ny, wy = _weights(y0, ch, oh)
    fx, nx, wx = _weights(x0, cw, ow)
    kx = wx.shape[1]
    # tap-major weights and clamped source columns (padding taps have weight 0)
    wxt = np.zeros((kx, ow), np.float32)
    src = np.empty((kx, ow), np.int64)
    for o in range(ow):
        for k in range(kx):
            if k < nx[o]:
                wxt[k, o] = wx[o, k]
                src[k, o] = (fx[o] + k) * chans
            else:
                src[k, o] = fx[o] * chans
    row_len = ow * 3
    tmp = scratch[:ch * row_len].reshape((ch, row_len))
    # separate small buffers (not views of scratch), so the compiler sees no aliasing
    acc = np.empty(ow, np.float32)
    line = np.empty(row_len, np.float32)
    rowf = np.empty(img.shape[1] * chans, np.float32)
    flat = img.reshape((img.shape[0], img.shape[1] * chans))
    # horizontal pass over the rows the vertical pass needs
    for r in range(ch):
        rowpix = flat[y0 + r]
        for j in range(rowf.size):
            rowf[j] = rowpix[j]
        t = tmp[r]
        for c in range(3):
            cc = c if chans == 3 else 0
            for o in range(ow):
                acc[o] = 0.0
            for k in range(kx):
                wk = wxt[k]
                sk = src[k]
                for o in range(ow):
                    acc[o] += wk[o] * rowf[sk[o] + cc]
            for o in range(ow):
                t[o * 3 + c] = acc[o]
    # vertical pass, a whole output row at a time
    simple = contrast == 1.0 and saturation == 1.0
    sc = np.empty(3, np.float32)
    off = np.empty(3, np.float32)
    for c in range(3):
        sc[c] = 1.0 / (255.0 * std[c])
        off[c] = mean[c] / std[c]
    gray_sum = 0.0
    for o in range(oh):
        for j in range(row_len):
            line[j] = 0.0
        base = fy[o] - y0
        for k in range(ny[o]):
            w = wy[o, k]
            src_row = tmp[base + k]
            for j in range(row_len):
                line[j] += w * src_row[j]
        for x in range(ow):
            xo = ow - 1 - x if flip else x
            for c in range(3):
                v = min(max(line[x * 3 + c] * brightness, 0.0), 255.0)
                if simple:
                    out[o, xo, c] = v * sc[c] - off[c]
                else:
                    out[o, xo, c] = v
            if not simple:
                gray_sum += 0.299 * out[o, xo, 0] + 0.587 * out[o, xo, 1] + 0.114 * out[o, xo, 2]
    if simple:
        return
    gray_mean = gray_sum / (oh * ow)
    for o in range(oh):
        for x in range(ow):
            v0 = out[o, x, 0]
            v1 = out[o, x, 1]
            v2 = out[o, x, 2]
            if contrast != 1.0:
                v0 = min(max((v0 - gray_mean) * contrast + gray_mean, 0.0), 255.0)
                v1 = min(max((v1 - gray_mean) * contrast + gray_mean, 0.0), 255.0)
                v2 = min(max((v2 - gray_mean) * contrast + gray_mean, 0.0), 255.0)
            if saturation != 1.0:
                g = 0.299 * v0 + 0.587 * v1 + 0.114 * v2
                v0 = min(max((v0 - g) * saturation + g, 0.0), 255.0)
                v1 = min(max((v1 - g) * saturation + g, 0.0), 255.0)
                v2 = min(max((v2 - g) * saturation + g, 0.0), 255.0)
            out[o, x, 0] = v0 * sc[0] - off[0]
            out[o, x, 1] = v1 * sc[1] - off[1]
            out[o, x, 2] = v2 * sc[2] - off[2]


def scratch_size(ch: int, ow: int) -> int:
    return ch * ow * 3


def crop_resize_normalize(img, y0, x0, ch, cw, out, flip, brightness, contrast, saturation, mean, std, scratch=None):
    """crop_resize_normalize_scratch with a scratch buffer allocated here when none is given."""
    if scratch is None or scratch.size < scratch_size(ch, out.shape[1]):
        scratch = np.empty(scratch_size(ch, out.shape[1]), np.float32)
    crop_resize_normalize_scratch(img, y0, x0, ch, cw, out, flip, brightness, contrast, saturation, mean, std,
                                  scratch)


crop_resize_normalize.py_func = lambda img, y0, x0, ch, cw, out, flip, b, c, s, mean, std, scratch=None: \
    crop_resize_normalize_scratch.py_func(img, y0, x0, ch, cw, out, flip, b, c, s, mean, std,
                                          np.empty(scratch_size(ch, out.shape[1]), np.float32))


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
