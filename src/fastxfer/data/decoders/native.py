"""The native decoder: the C++ core's libjpeg-turbo batch decoder (region-of-interest or tiled
decode streamed into the resampler, one call per batch on its own threads, without the GIL), and
finding the libjpeg-turbo it opens at run time (the copy inside Pillow's wheel)."""

from __future__ import annotations

import os

import numpy as np

from fastxfer import _core, settings

MAX_PIXELS = 1 << 28  # 268 M pixels: larger images are rejected (decompression bombs)


def libjpeg_path() -> str | None:
    """The libjpeg-turbo shared library the native decoder opens: $FASTXFER_LIBJPEG, else the copy
    bundled in Pillow's wheel, else the one the dynamic loader finds; None when there is none."""
    env = settings.get("FASTXFER_LIBJPEG")
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
    """(usable, why): whether Loader(decoder="native") can run here; `why` is the library's path
    when it can, the reason when it cannot."""
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


class NativeDecoder:
    """Decodes a batch of records into normalised slots with one `JpegBatchDecoder` call.

    Threads do not survive fork(): used in a forked child (multiprocessing's fork start method),
    it starts a new core decoder there; the inherited one is left alone (see docs/data.md)."""

    name = "native"

    def __init__(self, library: str, threads: int, max_pixels: int = MAX_PIXELS):
        self.threads, self.max_pixels = threads, max_pixels
        self.batch_decoder = _core.JpegBatchDecoder(library, threads, max_pixels)
        self._pid = os.getpid()

    def decode_batch(self, records, heights: np.ndarray, widths: np.ndarray, boxes: np.ndarray, flips: np.ndarray,
                     jitter: np.ndarray, mean: np.ndarray, std: np.ndarray, out: np.ndarray) -> list[str]:
        """Decode, crop, resize, flip, jitter and normalise records[k] into out[k] (float32 or
        bfloat16); returns one error message per image, "" where it succeeded."""
        if os.getpid() != self._pid:
            self.batch_decoder = _core.JpegBatchDecoder(self.batch_decoder.library_path, self.threads,
                                                        self.max_pixels)
            self._pid = os.getpid()
        return self.batch_decoder.decode_batch(records, heights.astype(np.int32), widths.astype(np.int32), boxes,
                                               flips, jitter, mean, std, out)

    def close(self) -> None:
        self.batch_decoder = None
