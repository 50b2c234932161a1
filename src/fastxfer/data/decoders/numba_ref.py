"""The reference decoder: simplejpeg decodes the image (DCT-scaled like the native path), and a
Numba kernel crops, resizes (bilinear, antialiased when shrinking), flips, colour-jitters and
normalises it straight into a batch slot, in a pool of Python threads. The native decoder is
tested against it, and the Loader falls back to it when the core was built without jpeglib.h.

Kernels are ``njit(nogil=True, cache=True)``: loader threads run them in parallel, off the GIL.
``FASTXFER_NO_JIT=1`` runs the same code as plain Python (for debugging); every kernel also has
``.py_func`` and the tests compare the two.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastxfer import settings

NO_JIT = settings.get("FASTXFER_NO_JIT")

if NO_JIT:
    def njit(*args, **kwargs):
        def wrap(f):
            f.py_func = f
            return f
        return wrap(args[0]) if args and callable(args[0]) else wrap
else:
    from numba import njit  # noqa: F401  (one place for the Numba options: below)

_OPTS = dict(nogil=True, cache=True, fastmath=False, error_model="numpy")

from fastxfer.data.decoders import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402,F401  (re-exported)
from fastxfer.data.decoders.native import MAX_PIXELS  # noqa: E402  (the same limit on both decoders)


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


def check_crop(img, y0: int, x0: int, ch: int, cw: int, out) -> None:
    """ValueError unless the crop lies inside img and out is a 3-channel slot: the Numba kernel
    has no bounds checks, so every call goes through here first."""
    if img.ndim != 3 or img.shape[2] not in (1, 3) or out.ndim != 3 or out.shape[2] != 3 or min(out.shape[:2]) < 1:
        raise ValueError(f"expected an HxWx1 or HxWx3 image and an HxWx3 slot, got {img.shape} and {out.shape}")
    if not (0 <= y0 and 0 <= x0 and ch >= 1 and cw >= 1 and y0 + ch <= img.shape[0] and x0 + cw <= img.shape[1]):
        raise ValueError(f"the crop box (y {y0}, x {x0}, h {ch}, w {cw}) is not inside the "
                         f"{img.shape[1]}x{img.shape[0]} (WxH) decoded image")


def crop_resize_normalize(img, y0, x0, ch, cw, out, flip, brightness, contrast, saturation, mean, std, scratch=None):
    """crop_resize_normalize_scratch with a scratch buffer allocated here when none is given (and
    the crop checked against the image first)."""
    check_crop(img, y0, x0, ch, cw, out)
    if scratch is None or scratch.size < scratch_size(ch, out.shape[1]):
        scratch = np.empty(scratch_size(ch, out.shape[1]), np.float32)
    crop_resize_normalize_scratch(img, y0, x0, ch, cw, out, flip, brightness, contrast, saturation, mean, std,
                                  scratch)


crop_resize_normalize.py_func = lambda img, y0, x0, ch, cw, out, flip, b, c, s, mean, std, scratch=None: \
    crop_resize_normalize_scratch.py_func(img, y0, x0, ch, cw, out, flip, b, c, s, mean, std,
                                          np.empty(scratch_size(ch, out.shape[1]), np.float32))


# ---- decoding ----------------------------------------------------------------------------------

def decode(data, height: int, width: int, box: tuple[int, int, int, int], out_hw: tuple[int, int]):
    """Decode just enough of a JPEG for `box` to be resized to out_hw: returns (image, box in the
    decoded image's coordinates). Uses DCT scaling by the largest of 8/4/2 that keeps the crop at
    least out_hw; grayscale stays one channel; CMYK (Adobe, inverted) is converted to RGB.

    ValueError, before any pixel is decoded, when the JPEG header's size is not (height, width)
    (the dataset index's) or the box is not inside it (the native decoder refuses the same)."""
    import simplejpeg

    y, x, h, w = box
    hh, ww, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    if (hh, ww) != (height, width):
        raise ValueError(f"the JPEG header says {ww}x{hh} (WxH) but the dataset index says {width}x{height}")
    if not (0 <= y and 0 <= x and h >= 1 and w >= 1 and y + h <= height and x + w <= width):
        raise ValueError(f"the crop box (y {y}, x {x}, h {h}, w {w}) lies outside the {width}x{height} image")
    oh, ow = out_hw
    factor = 1
    for f in (8, 4, 2):
        if h // f >= oh and w // f >= ow:
            factor = f
            break
    kw = {}
    if factor > 1:
        kw = dict(min_height=math.ceil(height / factor), min_width=math.ceil(width / factor), min_factor=factor)
    if colorspace == "GRAY":
        img = simplejpeg.decode_jpeg(data, colorspace="GRAY", **kw)
        if img.ndim == 2:
            img = img[:, :, None]
    elif colorspace == "CMYK":
        cmyk = simplejpeg.decode_jpeg(data, colorspace="CMYK", **kw).astype(np.uint16)
        img = (cmyk[..., :3] * cmyk[..., 3:4] // 255).astype(np.uint8)
    else:
        img = simplejpeg.decode_jpeg(data, colorspace="RGB", **kw)
    sy, sx = img.shape[0] / hh, img.shape[1] / ww
    y2, x2 = int(y * sy), int(x * sx)
    h2 = max(1, min(img.shape[0] - y2, int(round(h * sy))))
    w2 = max(1, min(img.shape[1] - x2, int(round(w * sx))))
    return img, (y2, x2, h2, w2)


class NumbaDecoder:
    """Decodes a batch of records into normalised float32 slots, one image per pool thread
    (decode() + crop_resize_normalize_scratch), with the native decoder's interface.

    Threads do not survive fork(): used in a forked child, it starts a new pool there."""

    name = "numba"

    def __init__(self, threads: int, max_pixels: int = MAX_PIXELS):
        self.threads, self.max_pixels = threads, int(max_pixels)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fastxfer-loader")
        self._pid = os.getpid()
        self._scratch = threading.local()  # per-thread resize buffer, reused across images

    def _one(self, data, height: int, width: int, box, flip: bool, jitter, mean, std, slot: np.ndarray) -> str:
        """Decode + augment one record into slot; "" or why the record is bad."""
        s_h, s_w = slot.shape[0], slot.shape[1]
        if height * width > self.max_pixels:  # as the native decoder: decompression bombs
            return f"the image is {width}x{height} = {height * width} pixels, over the limit of {self.max_pixels}"
        try:
            img, box2 = decode(data, height, width, tuple(int(v) for v in box), (s_h, s_w))
            check_crop(img, *box2, slot)  # the kernel reads without bounds checks
        except Exception as e:  # noqa: BLE001 - any decode failure means: this record is bad
            return str(e)
        scratch = getattr(self._scratch, "buf", None)
        need = scratch_size(box2[2], s_w)
        if scratch is None or scratch.size < need:
            scratch = self._scratch.buf = np.empty(max(need, scratch_size(1024, s_w)), np.float32)
        b, c, sat = (float(v) for v in jitter)
        crop_resize_normalize_scratch(img, *box2, slot, bool(flip), b, c, sat, mean, std, scratch)
        return ""

    def decode_batch(self, records, heights: np.ndarray, widths: np.ndarray, boxes: np.ndarray, flips: np.ndarray,
                     jitter: np.ndarray, mean: np.ndarray, std: np.ndarray, out: np.ndarray) -> list[str]:
        """Decode, crop, resize, flip, jitter and normalise records[k] into out[k] (float32);
        returns one error message per image, "" where it succeeded."""
        if os.getpid() != self._pid:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastxfer-loader")
            self._pid = os.getpid()
        return list(self._pool.map(lambda k: self._one(records[k], int(heights[k]), int(widths[k]), boxes[k],
                                                       flips[k], jitter[k], mean, std, out[k]), range(len(records))))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
