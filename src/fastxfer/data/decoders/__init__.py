"""Decoders: encoded JPEG records -> cropped, resized, augmented, normalised batch slots.
``native`` (the C++ core with libjpeg-turbo) and ``numba_ref`` (simplejpeg + Numba, the
reference) do the same arithmetic behind one interface: ``decode_batch(records, heights, widths,
boxes, flips, jitter, mean, std, out) -> per-image error messages``.

Only ``native`` is imported with the package: ``numba_ref`` needs Numba (the ``data`` extra) and
is imported when a Loader falls back to it, so the ``fastxfer`` command and the native path work
without it."""

import numpy as np

# the normalisation both decoders default to (the Loader's mean/std): ImageNet's statistics
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
