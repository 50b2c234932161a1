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

Bad input (docs/data.md, "Bad input"):

- A pack whose index or metadata breaks the format (records outside the data region, a zero
  height or width, a label outside 0..num_classes-1, metadata that is not a JSON object) is a
  PackedFormatError naming the record and the field when the Loader is created; so is a
  ``num_classes`` argument below a label of the pack.
- Bad records (checksum mismatch, undecodable, a JPEG header whose size is not the index's, a
  colour space libjpeg-turbo cannot convert) never stop the loader and never get another record's
  label: the slot is filled with another image of the same batch together with that image's
  label, ``loader.skipped`` counts them, and a warning per batch that had any names one of them.
- A batch with no readable record at all is filled the same way from the next readable records
  of this rank's epoch order (wrapping around), so every epoch still has ``len(loader)`` full
  batches and the ranks of a job keep stepping together; ``loader.skipped`` counts its records,
  ``loader.skipped_batches`` the batch, and it is warned about. Only when no record of this
  rank's epoch can be read is it an error (PackedFormatError).
"""

from __future__ import annotations

import math
import operator
import os
import queue
import threading

import numpy as np

from fastxfer import settings
from fastxfer.data.adapters import as_keras, as_tf_dataset
from fastxfer.data.decoders.native import MAX_PIXELS, NativeDecoder, native_decoder_status
from fastxfer.data.decoders import IMAGENET_MEAN, IMAGENET_STD
from fastxfer.data.format import PackedFormatError
from fastxfer.data.reader import PackedDataset
from fastxfer.data.sampling import augment_params, image_uniforms, mixup
from fastxfer.log import logger


MAX_TARGET_BYTES = 1 << 30  # one-hot (mixup / label smoothing) targets per batch: larger is refused


def _rank_and_size(rank: int | None, size: int | None) -> tuple[int, int]:
    """The given rank and size, else the job's (0 of 1 before init); ValueError when inconsistent."""
    if rank is None or size is None:
        import fastxfer as fx

        r, s = (fx.rank(), fx.size()) if fx.is_initialized() else (0, 1)
        rank = r if rank is None else rank
        size = s if size is None else size
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside 0..{size - 1}")
    return int(rank), int(size)


def _default_threads() -> int:
    n = settings.get("FASTXFER_LOADER_THREADS")
    return n if n is not None else max(1, len(os.sched_getaffinity(0)))


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
        rank, size = _rank_and_size(rank, size)
        self.ds = PackedDataset(str(path), verify=verify)
        try:  # the pack is open: close it if anything below refuses
            if cache:
                self.ds.cache()
            self.batch_size, self.image_size, self.train = batch_size, int(image_size), train
            self.threads = threads or _default_threads()
            self.seed, self.rank, self.size, self.dtype = seed, rank, size, dtype
            self.mixup_alpha, self.label_smoothing = mixup_alpha, label_smoothing
            self.num_classes = self._check_num_classes(num_classes)
            if mixup_alpha > 0 or label_smoothing > 0:
                target_bytes = batch_size * self.num_classes * 4
                if target_bytes > MAX_TARGET_BYTES:
                    raise ValueError(f"mixup/label smoothing make (batch, num_classes) float32 targets: {batch_size} x "
                                     f"{self.num_classes} is {target_bytes / 2**30:.1f} GiB per batch, over the limit "
                                     f"of {MAX_TARGET_BYTES / 2**30:.0f} GiB")
            self.color_jitter, self.scale, self.ratio, self.flip = color_jitter, scale, ratio, flip
            self.prefetch = max(1, prefetch)
            self.drop_last = train if drop_last is None else drop_last
            self.mean = np.asarray(mean, np.float32)
            self.std = np.asarray(std, np.float32)
            self.epoch = 0
            self.start = 0  # records of this epoch's order the job has already trained on (resume)
            self.skipped = 0  # bad records met (each time it is read), see the module docstring
            self.skipped_batches = 0  # batches none of whose records could be read (filled from other records)
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
                    logger.warning("fastxfer.data: native JPEG decoder unavailable (%s); using simplejpeg + Numba, "
                                   "which is slower", why)
            if self._decoder is None:
                try:
                    from fastxfer.data.decoders.numba_ref import NumbaDecoder
                except ImportError as e:
                    raise RuntimeError(f"fastxfer.data: no JPEG decoder can run here: the native one is unavailable "
                                       f"and the Numba fallback cannot be imported ({e}); "
                                       f"pip install 'fastxfer[data]'") from e
                self._decoder = NumbaDecoder(self.threads, self.max_pixels)
            self.decoder = self._decoder.name
        except BaseException:
            self.ds.close()
            raise

    def _check_num_classes(self, num_classes) -> int:
        """The pack's number of classes (labels checked against it on open), or the `num_classes`
        argument (None or 0: the pack's) when no label of the pack is outside it: a smaller one
        would leave labels without a class (and wrap or overflow a one-hot row)."""
        have = self.ds.num_classes
        if not num_classes:
            return have
        n = operator.index(num_classes)
        if n < 1:
            raise ValueError(f"num_classes must be >= 1, got {n}")
        labels = self.ds.labels
        bad = np.flatnonzero(labels >= n)
        if bad.size:
            i = int(bad[0])
            raise PackedFormatError(f"{self.ds.path}: index record {i}: label {int(labels[i])} is not below "
                                    f"num_classes={n} (the pack's labels are 0..{have - 1})")
        return n

    @property
    def native_decoder(self):
        """The core's JpegBatchDecoder this loader decodes with (None on the Numba path): for
        benchmarks and tests that switch its modes (tiles, decode-only)."""
        return getattr(self._decoder, "batch_decoder", None)

    # -- which records, in which order ------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Reshuffle (train) for this epoch; every rank must call it with the same value."""
        self.epoch = int(epoch)
        self.start = 0

    def resume(self, epoch: int, start: int = 0, rank: int | None = None, size: int | None = None) -> None:
        """Go on with epoch ``epoch`` after the first ``start`` records of its order, shared out
        afresh among ``size`` ranks (default: the job's current rank and size) -- after an elastic
        reset, the group may have a new size.

        The epoch's order is the same permutation on every rank; the ranks have trained on a prefix
        of it (each step takes the next ``batch_size x size`` records), so ``start`` is the number
        of steps done times the global batch (``loader.global_batch`` then). The rest of the order
        is dealt out to the new ranks: no record of the epoch is lost or seen twice because of the
        reset (at most ``size - 1`` of the tail are left out, as in any epoch, so that every rank
        has the same number of batches)."""
        rank, size = _rank_and_size(rank, size)
        start = int(start)
        if not 0 <= start <= len(self.ds):
            raise ValueError(f"start {start} is outside 0..{len(self.ds)} (the records of the pack)")
        self.rank, self.size = int(rank), int(size)
        self.epoch = int(epoch)
        self.start = start

    @property
    def global_batch(self) -> int:
        """Records the whole job takes per step: batch_size x size."""
        return self.batch_size * self.size

    def indices(self) -> np.ndarray:
        n = len(self.ds)
        if self.train:
            perm = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch])).permutation(n)
            rest = perm[self.start:]
            per_rank = len(rest) // self.size
            return rest[self.rank::self.size][:per_rank]
        return np.arange(n)[self.start:][self.rank::self.size]

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
        if len(good) < n and n:
            first_error = self._last_error
            sources, src_labels = images, labels
            if not good:  # no slot of this batch can be filled from the batch itself
                sources, src_labels, good, used = self._replacements(b, n, images.dtype)
            for j, k in enumerate(k for k in range(n) if not ok[k]):
                src = good[j % len(good)]
                images[k] = sources[src]
                labels[k] = src_labels[src]
            bad = n - sum(ok)
            self.skipped += bad
            if sum(ok):
                logger.warning(f"fastxfer.data: skipped {bad} unreadable record(s) in batch {b} of epoch "
                               f"{self.epoch} (e.g. {first_error}); their slots hold other images of the batch, with "
                               f"their labels")
            else:
                self.skipped_batches += 1
                logger.warning(f"fastxfer.data: skipped batch {b} of epoch {self.epoch}: none of its {n} record(s) "
                               f"is readable (e.g. {first_error}); its slots hold other records of this rank's "
                               f"epoch ({', '.join(map(str, used[:8]))}{', ...' if len(used) > 8 else ''}), with "
                               f"their labels")
        targets = labels
        if self.mixup_alpha > 0 or self.label_smoothing > 0:
            mrng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch, self.rank, b, 1]))
            images, targets = mixup(images, labels, self.num_classes, self.mixup_alpha, self.label_smoothing, mrng)
        if self.dtype == "bfloat16" and not native_bf16:
            import fastxfer as fx

            images = fx.compress(images, "bf16")
        return images, targets

    def _replacements(self, b: int, n: int, dtype):
        """For a batch b with no readable record: (images, labels, good slots, records) of the next
        readable records of this rank's epoch order after the batch (wrapping around), decoded
        chunk by chunk until one has any; PackedFormatError when none of them is readable."""
        order = self.indices()
        start = (b + 1) * self.batch_size
        rest = np.concatenate([order[start:], order[:b * self.batch_size]])
        s = self.image_size
        for c in range(0, len(rest), n):
            idx = rest[c:c + n]
            images = np.empty((len(idx), s, s, 3), dtype)
            ok = self._decode(idx, self.params(idx), images)
            good = [k for k in range(len(idx)) if ok[k]]
            if good:
                return images, self.ds.labels[idx].astype(np.int32), good, [int(idx[k]) for k in good]
        raise PackedFormatError(f"{self.ds.path}: none of the {len(order)} records this rank reads in epoch "
                                f"{self.epoch} is readable (e.g. {self._last_error})")

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
