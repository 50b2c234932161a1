"""Horovod's compression interface: ``Compression.none / fp16 / bf16`` and user-written compressors.

A compressor has Horovod's two methods (static methods on a class, or methods of an instance):
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``.

fastxfer's built-in compressors are also the engine's wire-format names: ``Compression.bf16`` is an
object with ``compress``/``decompress`` *and* the string ``"bf16"`` (a ``str`` subclass), so every
place that takes the names takes the compressors too (``compression="bf16"``, the numpy API); the
collectives' options (fastxfer.comm.options) tell built-ins from user compressors. Handed to a collective, a built-in compressor is not called in
TensorFlow: the engine rounds float32 data to 16 bits on the wire and reduces in float32 (more
accurate than Horovod's fp16 path, which reduces in fp16). Calling ``Compression.fp16.compress(t)``
yourself does what Horovod's does (cast floating tensors to float16).

Any other object with ``compress`` and ``decompress`` (for example a subclass of ``Compressor``,
passed as the class, as Horovod scripts do) runs in TensorFlow around an uncompressed reduction:
compress before, reduce the compressed tensor as it is (its dtype must be one fastxfer reduces),
decompress after.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface for compressing and decompressing a tensor (Horovod's ``Compressor``)."""

    @staticmethod
    def compress(tensor):
        """Returns (compressed tensor, context needed to decompress it)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor decompressed with ``ctx``."""
        raise NotImplementedError


class _Builtin(str, Compressor):
    """A built-in compressor: the engine's wire-format name (a str) with Horovod's methods."""

    _wire_dtype = None  # what compress() casts floating tensors to (None: unchanged)

    def compress(self, tensor):  # noqa: D102 - as Compressor
        t = tf.convert_to_tensor(tensor)
        if self._wire_dtype is not None and t.dtype.is_floating:
            return tf.cast(t, self._wire_dtype), t.dtype
        return t, t.dtype

    def decompress(self, tensor, ctx):  # noqa: D102 - as Compressor
        if self._wire_dtype is not None and ctx is not None and tf.as_dtype(ctx).is_floating:
            return tf.cast(tensor, ctx)
        return tensor

    def __repr__(self):
        return f"Compression.{str(self)}"

    def __reduce__(self):  # pickles as the built-in it is (picklable settings, broadcast_object)
        return (_builtin, (str(self),))


class NoneCompressor(_Builtin):
    """No compression (``Compression.none``, equal to ``"none"``)."""


class FP16Compressor(_Builtin):
    """float32 gradients travel as float16 (``Compression.fp16``, equal to ``"fp16"``)."""

    _wire_dtype = tf.float16


class BF16Compressor(_Builtin):
    """float32 gradients travel as bfloat16 (``Compression.bf16``, equal to ``"bf16"``; not in Horovod)."""

    _wire_dtype = tf.bfloat16


class Compression:
    """Optional gradient compression algorithm used during allreduce (Horovod's names)."""

    none = NoneCompressor("none")
    fp16 = FP16Compressor("fp16")
    bf16 = BF16Compressor("bf16")


def _builtin(name: str):
    return getattr(Compression, name)
