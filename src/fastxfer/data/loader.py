"""The per-rank loader: packed records -> decoded, cropped, augmented, normalised NHWC batches.

Each epoch every rank draws the same permutation (seed, epoch) and takes every size-th record
from it, truncated so all ranks get the same number of batches (ranks of a data-parallel job
must step together). Two decoders, the same images up to float rounding:

- ``"native"`` (the default when available): the C++ core decodes only the crop's scanlines and
  iMCU columns with libjpeg-turbo (the copy inside Pillow's wheel, opened at run time), shrunk in
  the DCT domain by 2/4/8 when the crop will be shrunk at least that much, and streams the rows
  into the resampler, which writes the normalised float32/bf16 batch slot; one call per batch, on
  the decoder's own threads, without the GIL.
- ``"numba"``: simplejpeg decodes the whole image (DCT-scaled the same way), and the Numba kernel
  crops, resizes and normalises it, in a pool of Python threads. The reference, and the fallback
  when the core was built without jpeglib.h.

A background thread keeps `prefetch` batches ready.

Bad records (checksum mismatch, undecodable, a colour space libjpeg-turbo cannot convert) never
stop the loader and never get another record's label: the slot is filled with another image of
the same batch together with that image's label, ``loader.skipped`` counts them, and a warning
names the first one of each epoch.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastxfer.data import kernels as K
from fastxfer.data.packed import PackedDataset


def _default_threads() -> int:
    env = os.environ.get("FASTXFER_LOADER_THREADS")
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)))


_MAX_PIXELS = 1 << 28  # 268 M pixels: larger images are rejected (decompression bombs)


def libjpeg_path() -> str | None:
    """The libjpeg-turbo shared library the native decoder opens: $FASTXFER_LIBJPEG, else the copy
    bundled in Pillow's wheel, else the one the dynamic loader finds; None when there is none."""
    env = os.environ.get("FASTXFER_LIBJPEG")
    if env:
        return env
    import glob
    import importlib.util

    spec = importlib.util.find_spec("PIL")
    if spec is not None and spec.origin:
        site = os.path.dirname(os.path.dirname(spec.origin))
        for pattern in ("pillow.libs/libjpeg*.so*", "PIL/.dylibs/libjpeg*.dylib", "Pillow.libs/libjpeg*.so*"):
            hits = sorted(glob.glob(os.path.join(site, pattern)))
            if hits:
                return hits[0]
    import ctypes.util

    return ctypes.util.find_library("jpeg")


def native_decoder_status() -> tuple[bool, str]:
    """(usable, why): whether Loader(decoder="native") can run here."""
    from fastxfer import _core

    built, note = _core.jpeg_support()
    if not built:
        return False, note
    path = libjpeg_path()
    if not path:
        return False, "no libjpeg-turbo found: install Pillow (its wheel bundles one) or set FASTXFER_LIBJPEG"
    try:
        _core.JpegBatchDecoder(path, 1)
    except RuntimeError as e:
        return False, str(e)
    return True, path


def decode(data, height: int, width: int, box: tuple[int, int, int, int], out_hw: tuple[int, int]):
    """Decode just enough of a JPEG for `box` to be resized to out_hw: returns (image, box in the
    decoded image's coordinates). Uses DCT scaling by the largest of 8/4/2 that keeps the crop at
    least out_hw; grayscale stays one channel; CMYK (Adobe, inverted) is converted to RGB."""
    import simplejpeg

    y, x, h, w = box
    oh, ow = out_hw
    factor = 1
    for f in (8, 4, 2):
        if h // f >= oh and w // f >= ow:
            factor = f
            break
    kw = {}
    if factor > 1:
        kw = dict(min_height=math.ceil(height / factor), min_width=math.ceil(width / factor), min_factor=factor)
    hh, ww, colorspace, _ = simplejpeg.decode_jpeg_header(data)
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


class Loader:
    """Iterable over (images, labels) batches for this rank. See the module docstring."""

    def __init__(self, path, batch_size: int, image_size: int = 224, train: bool = True, threads: int | None = None,
                 seed: int = 0, rank: int | None = None, size: int | None = None, dtype: str = "float32",
                 mixup_alpha: float = 0.0, label_smoothing: float = 0.0, num_classes: int | None = None,
                 color_jitter: tuple[float, float, float] = (0.0, 0.0, 0.0), scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip: bool = True, cache: bool = False, prefetch: int = 2,
                 drop_last: bool | None = None, verify: bool = True, mean=K.IMAGENET_MEAN, std=K.IMAGENET_STD,
                 decoder: str = "auto", max_pixels: int = _MAX_PIXELS):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")
        if rank is None or size is None:
            import fastxfer as fx

            r, s = (fx.rank(), fx.size()) if fx.is_initialized() else (0, 1)
            rank = r if rank is None else rank
            size = s if size is None else size
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        self.ds = PackedDataset(str(path), verify=verify)
        if cache:
            self._blob = bytes(self.ds._mm)  # the whole file in memory (one copy)
        else:
            self._blob = None
        self.batch_size, self.image_size, self.train = batch_size, int(image_size), train
        self.threads = threads or _default_threads()
        self.seed, self.rank, self.size, self.dtype = seed, rank, size, dtype
        self.mixup_alpha, self.label_smoothing = mixup_alpha, label_smoothing
        labels = self.ds.labels
        self.num_classes = num_classes or (int(labels.max()) + 1 if len(labels) else 0)
        self.color_jitter, self.scale, self.ratio, self.flip = color_jitter, scale, ratio, flip
        self.prefetch = max(1, prefetch)
        self.drop_last = train if drop_last is None else drop_last
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)
        self.epoch = 0
        self.skipped = 0
        if decoder not in ("auto", "native", "numba"):
            raise ValueError(f"decoder must be 'auto', 'native' or 'numba', not {decoder!r}")
        self.max_pixels = int(max_pixels)
        self._native = None
        self._pool = None
        if decoder in ("auto", "native"):
            usable, why = native_decoder_status()
            if usable:
                from fastxfer import _core

                self._native = _core.JpegBatchDecoder(why, self.threads, self.max_pixels)
            elif decoder == "native":
                raise RuntimeError(f"the native JPEG decoder is not available: {why} (use decoder='numba')")
            else:
                warnings.warn(f"fastxfer.data: native JPEG decoder unavailable ({why}); using simplejpeg + Numba, "
                              f"which is slower", RuntimeWarning, stacklevel=2)
        self.decoder = "native" if self._native is not None else "numba"
        if self._native is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastxfer-loader")
        self._pid = os.getpid()
        self._scratch = threading.local()  # per-thread resize buffer, reused across images

    # -- which records, in which order ------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Reshuffle (train) for this epoch; every rank must call it with the same value."""
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray:
        n = len(self.ds)
        if self.train:
            perm = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch])).permutation(n)
            per_rank = n // self.size
            return perm[self.rank::self.size][:per_rank]
        return np.arange(n)[self.rank::self.size]

    def __len__(self) -> int:
        m = len(self.indices())
        return m // self.batch_size if self.drop_last else math.ceil(m / self.batch_size)

    # -- one batch ----------------------------------------------------------------------------------
    def _record(self, i: int):
        if self._blob is None:
            return self.ds.record(i)
        rec = self.ds.index[i]
        off, n = int(rec["offset"]), int(rec["size"])
        return self.ds.checked(i, memoryview(self._blob)[off:off + n])

    def params(self, idx) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(boxes (n, 4) of (y, x, h, w), flips (n,), jitter (n, 3)) for records idx this epoch:
        drawn from (seed, epoch, rank, record), the same whichever decoder runs or batch holds them."""
        idx = np.asarray(idx, np.int64)
        u = K.image_uniforms(self.seed, self.epoch, self.rank, idx) if self.train else None
        return K.augment_params(u, self.ds.heights[idx], self.ds.widths[idx], self.train, self.scale, self.ratio,
                                self.flip, self.color_jitter)

    def _one(self, i: int, box, flip: bool, jitter, slot: np.ndarray) -> bool:
        """Decode + augment record i into slot with simplejpeg + Numba; False if the record is bad."""
        h, w = int(self.ds.heights[i]), int(self.ds.widths[i])
        s = self.image_size
        try:
            img, box2 = decode(self._record(i), h, w, tuple(int(v) for v in box), (s, s))
        except Exception as e:  # noqa: BLE001 - any decode failure means: this record is bad
            self._last_error = f"record {int(i)}: {e}"
            return False
        scratch = getattr(self._scratch, "buf", None)
        need = K.scratch_size(box2[2], s)
        if scratch is None or scratch.size < need:
            scratch = self._scratch.buf = np.empty(max(need, K.scratch_size(1024, s)), np.float32)
        b, c, sat = (float(v) for v in jitter)
        K.crop_resize_normalize_scratch(img, *box2, slot, bool(flip), b, c, sat, self.mean, self.std, scratch)
        return True

    def _native_batch(self, idx: np.ndarray, params, images: np.ndarray) -> list[bool]:
        boxes, flips, jitter = params
        records = []
        bad = {}
        for k, i in enumerate(idx):
            try:
                records.append(self._record(int(i)))
            except Exception as e:  # noqa: BLE001 - a checksum mismatch: this record is bad
                bad[k] = f"record {int(i)}: {e}"
                records.append(b"")
        errors = self._native.decode_batch(records, self.ds.heights[idx].astype(np.int32),
                                           self.ds.widths[idx].astype(np.int32), boxes, flips, jitter,
                                           self.mean, self.std, images)
        ok = []
        for k, e in enumerate(errors):
            if k in bad:
                self._last_error = bad[k]
                ok.append(False)
            elif e:
                self._last_error = f"record {int(idx[k])}: {e}"
                ok.append(False)
            else:
                ok.append(True)
        return ok

    def _after_fork(self) -> None:
        """Threads do not survive fork(): a Loader used in a forked child (multiprocessing with
        the fork start method) starts its own decoder threads there."""
        if os.getpid() == self._pid:
            return
        if self._native is not None:
            from fastxfer import _core

            self._native = _core.JpegBatchDecoder(self._native.library_path, self.threads, self.max_pixels)
        if self._pool is not None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastxfer-loader")
        self._pid = os.getpid()

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch number b of the current epoch (random access: the same call gives the same batch)."""
        self._after_fork()
        idx = self.indices()[b * self.batch_size:(b + 1) * self.batch_size]
        n, s = len(idx), self.image_size
        # bf16 straight from the kernel, unless mixup still has to blend in float32
        native_bf16 = self.dtype == "bfloat16" and self._native is not None and self.mixup_alpha <= 0
        if native_bf16:
            import ml_dtypes

            images = np.empty((n, s, s, 3), ml_dtypes.bfloat16)
        else:
            images = np.empty((n, s, s, 3), np.float32)
        params = self.params(idx)
        if self._native is not None:
            ok = self._native_batch(idx, params, images)
        else:
            boxes, flips, jitter = params
            ok = list(self._pool.map(lambda k: self._one(idx[k], boxes[k], flips[k], jitter[k], images[k]), range(n)))
        labels = self.ds.labels[idx].astype(np.int32)
        good = [k for k in range(n) if ok[k]]
        if len(good) < n:
            if not good:
                raise RuntimeError(f"every record of batch {b} is unreadable ({self._last_error})")
            for j, k in enumerate(k for k in range(n) if not ok[k]):
                src = good[j % len(good)]
                images[k] = images[src]
                labels[k] = labels[src]
            bad = n - len(good)
            self.skipped += bad
            warnings.warn(f"fastxfer.data: skipped {bad} unreadable record(s) in batch {b} of epoch {self.epoch} "
                          f"(e.g. {self._last_error}); their slots hold other images of the batch, with their labels",
                          RuntimeWarning, stacklevel=2)
        targets = labels
        if self.mixup_alpha > 0 or self.label_smoothing > 0:
            mrng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch, self.rank, b, 1]))
            images, targets = K.mixup(images, labels, self.num_classes, self.mixup_alpha, self.label_smoothing, mrng)
        if self.dtype == "bfloat16" and not native_bf16:
            import fastxfer as fx

            images = fx.compress(images, "bf16")
        return images, targets

    def __iter__(self):
        nb = len(self)
        q: queue.Queue = queue.Queue(self.prefetch)
        stop = threading.Event()

        def produce():
            try:
                for b in range(nb):
                    if stop.is_set():
                        return
                    q.put(("ok", self.batch(b)))
                q.put(("end", None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put(("error", e))

        t = threading.Thread(target=produce, name="fastxfer-prefetch", daemon=True)
        t.start()
        try:
            while True:
                kind, item = q.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            stop.set()
            while t.is_alive():  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(timeout=0.05)

    # -- framework adapters -----------------------------------------------------------------------
    def as_keras(self):
        """A keras.utils.PyDataset over this loader (reshuffles at each epoch end)."""
        import keras

        loader = self

        class _Data(keras.utils.PyDataset):
            def __init__(self):
                super().__init__(workers=1, use_multiprocessing=False)

            def __len__(self):
                return len(loader)

            def __getitem__(self, i):
                return loader.batch(i)

            def on_epoch_end(self):
                loader.set_epoch(loader.epoch + 1)

        return _Data()

    def as_tf_dataset(self):
        """A tf.data.Dataset yielding this loader's batches (prefetched by the loader itself)."""
        import tensorflow as tf

        s = self.image_size
        img_dtype = tf.bfloat16 if self.dtype == "bfloat16" else tf.float32
        soft = self.mixup_alpha > 0 or self.label_smoothing > 0
        label_spec = (tf.TensorSpec((None, self.num_classes), tf.float32) if soft else tf.TensorSpec((None,), tf.int32))

        def gen():
            for images, targets in self:
                yield images, targets

        return tf.data.Dataset.from_generator(
            gen, output_signature=(tf.TensorSpec((None, s, s, 3), img_dtype), label_spec))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._native = None
        self.ds.close()

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
