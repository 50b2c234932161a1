"""The per-rank loader: packed records -> decoded, cropped, augmented, normalised NHWC batches.

Each epoch every rank draws the same permutation (seed, epoch) and takes every size-th record
from it, truncated so all ranks get the same number of batches (ranks of a data-parallel job
must step together). Augmentation parameters come from sampling.py; two decoders (decoders/),
the same images up to float rounding:

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
per batch that had any names one of them.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import warnings

import numpy as np

from fastxfer.data.adapters import as_keras, as_tf_dataset
from fastxfer.data.decoders.native import MAX_PIXELS, NativeDecoder, native_decoder_status
from fastxfer.data.decoders import IMAGENET_MEAN, IMAGENET_STD
from fastxfer.data.reader import PackedDataset
from fastxfer.data.sampling import augment_params, image_uniforms, mixup


def _default_threads() -> int:
    env = os.environ.get("FASTXFER_LOADER_THREADS")
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)))


class Loader:
    """Iterable over (images, labels) batches for this rank. See the module docstring."""

    def __init__(self, path, batch_size: int, image_size: int = 224, train: bool = True, threads: int | None = None,
                 seed: int = 0, rank: int | None = None, size: int | None = None, dtype: str = "float32",
                 mixup_alpha: float = 0.0, label_smoothing: float = 0.0, num_classes: int | None = None,
                 color_jitter: tuple[float, float, float] = (0.0, 0.0, 0.0), scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip: bool = True, cache: bool = False, prefetch: int = 2,
                 drop_last: bool | None = None, verify: bool = True, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                 decoder: str = "auto", max_pixels: int = MAX_PIXELS):
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
            self.ds.cache()
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
        self._decoder = None
        if decoder in ("auto", "native"):
            usable, why = native_decoder_status()
            if usable:
                self._decoder = NativeDecoder(why, self.threads, self.max_pixels)
            elif decoder == "native":
                raise RuntimeError(f"the native JPEG decoder is not available: {why} (use decoder='numba')")
            else:
                warnings.warn(f"fastxfer.data: native JPEG decoder unavailable ({why}); using simplejpeg + Numba, "
                              f"which is slower", RuntimeWarning, stacklevel=2)
        if self._decoder is None:
            try:
                from fastxfer.data.decoders.numba_ref import NumbaDecoder
            except ImportError as e:
                raise RuntimeError(f"fastxfer.data: no JPEG decoder can run here: the native one is unavailable and "
                                   f"the Numba fallback cannot be imported ({e}); pip install 'fastxfer[data]'") from e
            self._decoder = NumbaDecoder(self.threads)
        self.decoder = self._decoder.name

    @property
    def native_decoder(self):
        """The core's JpegBatchDecoder this loader decodes with (None on the Numba path): for
        benchmarks and tests that switch its modes (tiles, decode-only)."""
        return getattr(self._decoder, "batch_decoder", None)

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
    def params(self, idx) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(boxes (n, 4) of (y, x, h, w), flips (n,), jitter (n, 3)) for records idx this epoch:
        drawn from (seed, epoch, rank, record), the same whichever decoder runs or batch holds them."""
        idx = np.asarray(idx, np.int64)
        u = image_uniforms(self.seed, self.epoch, self.rank, idx) if self.train else None
        return augment_params(u, self.ds.heights[idx], self.ds.widths[idx], self.train, self.scale, self.ratio,
                              self.flip, self.color_jitter)

    def _decode(self, idx: np.ndarray, params, images: np.ndarray) -> list[bool]:
        """Decode records idx into images; False for each bad record (its reason in _last_error)."""
        boxes, flips, jitter = params
        records = []
        bad = {}
        for k, i in enumerate(idx):
            try:
                records.append(self.ds.record(int(i)))
            except Exception as e:  # noqa: BLE001 - a checksum mismatch: this record is bad
                bad[k] = f"record {int(i)}: {e}"
                records.append(b"")
        errors = self._decoder.decode_batch(records, self.ds.heights[idx], self.ds.widths[idx], boxes, flips, jitter,
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

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch number b of the current epoch (random access: the same call gives the same batch)."""
        idx = self.indices()[b * self.batch_size:(b + 1) * self.batch_size]
        n, s = len(idx), self.image_size
        # bf16 straight from the kernel, unless mixup still has to blend in float32
        native_bf16 = self.dtype == "bfloat16" and self.decoder == "native" and self.mixup_alpha <= 0
        if native_bf16:
            import ml_dtypes

            images = np.empty((n, s, s, 3), ml_dtypes.bfloat16)
        else:
            images = np.empty((n, s, s, 3), np.float32)
        ok = self._decode(idx, self.params(idx), images)
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
            images, targets = mixup(images, labels, self.num_classes, self.mixup_alpha, self.label_smoothing, mrng)
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
        return as_keras(self)

    def as_tf_dataset(self):
        """A tf.data.Dataset yielding this loader's batches (prefetched by the loader itself)."""
        return as_tf_dataset(self)

    def close(self) -> None:
        self._decoder.close()
        self.ds.close()
