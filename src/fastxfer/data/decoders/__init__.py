"""Decoders: encoded JPEG records -> cropped, resized, augmented, normalised batch slots.
``native`` (the C++ core with libjpeg-turbo) and ``numba_ref`` (simplejpeg + Numba, the
reference) do the same arithmetic behind one interface: ``decode_batch(records, heights, widths,
boxes, flips, jitter, mean, std, out) -> per-image error messages``."""
