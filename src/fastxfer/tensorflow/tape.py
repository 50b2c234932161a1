"""DistributedGradientTape and the gradient reduction behind it (``reduce_gradients``, which
fastxfer.keras's DistributedOptimizer uses too)."""

from __future__ import annotations

import tensorflow as tf

from fastxfer import _validate
from fastxfer.tensorflow import ops, overlap


class DistributedGradientTape:
    """Wraps a tf.GradientTape: ``gradient()`` averages the gradients across ranks.

    Gradients are submitted last variable first (the order a backward pass produces them, the
    same on every rank), fused by the engine into buckets, and reduced while later gradients are
    still being submitted. ``None`` gradients stay None on every rank (the variable lists must
    match across ranks).
    """

    def __init__(self, tape: tf.GradientTape, compression=ops.Compression.none, op=ops.Average,
                 gradient_predivide_factor=1.0):
        self._tape = tape
        self._compression = compression
        self._op = ops.check_op(op)
        self._predivide = float(gradient_predivide_factor)

    def __getattr__(self, item):
        return getattr(self._tape, item)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None, **kw):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kw)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        reduced = reduce_gradients(flat, flat_sources, op=self._op, compression=self._compression,
                                   gradient_predivide_factor=self._predivide, prefix="DistributedGradientTape")
        return tf.nest.pack_sequence_as(grads, reduced)


def reduce_gradients(grads, variables, op=ops.Average, compression=ops.Compression.none, gradient_predivide_factor=1.0,
                     bucket_cap_mb=None, prefix="grad"):
    """Allreduce a list of gradients (one per variable) the way DistributedGradientTape and
    DistributedOptimizer do: submitted last variable first (the order a backward pass produces
    them), fused by the engine. A None gradient stays None and is not communicated (Keras then
    skips its variable, as it would in one process): every rank must have None for the same
    variables -- they do when every rank runs the same model code -- otherwise the ranks submit
    different requests and all of them raise MismatchError naming the gradient. IndexedSlices are
    made dense. In a traced function each submit is pinned into the backward pass when
    ``overlap.pin_enabled()``."""
    grads = list(grads)
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    op = ops.check_op(op)
    f = float(gradient_predivide_factor)
    if f <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, not {gradient_predivide_factor}")
    compression = _validate.compression(compression)
    pre, post = (1.0 / f, f) if op == ops.Average else (1.0, 1.0)
    dense, names, where = [], [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        dense.append(tf.convert_to_tensor(g))
        names.append(f"{prefix}.{i}.{_short_name(v)}")
        where.append(i)
    out = list(grads)
    if not dense:
        return out
    # compression applies to float32 gradients; others (float16/bfloat16 variables) travel as they are
    comps = [compression if d.dtype == tf.float32 else ops.Compression.none for d in dense]
    order = list(reversed(range(len(dense))))
    for c in dict.fromkeys(comps):  # one group per wire format, each in backward order
        idx = [j for j in order if comps[j] == c]
        red = _allreduce_group([dense[j] for j in idx], [names[j] for j in idx], op, c, pre, post, bucket_cap_mb)
        for j, r in zip(idx, red):
            out[where[j]] = r
    return out


def _allreduce_group(grads, names, op, compression, pre, post, bucket_cap_mb):
    """grouped_allreduce in list order; traced, with the submits pinned into the backward pass."""
    if tf.executing_eagerly():
        return ops.grouped_allreduce(grads, op=op, compression=compression, prescale_factor=pre, postscale_factor=post,
                                     names=names, bucket_cap_mb=bucket_cap_mb)
    submits = ops.submit_grouped(grads, names, op, compression, pre, post, bucket_cap_mb=bucket_cap_mb)
    if overlap.pin_enabled():
        overlap.pin_to_backward(tf.compat.v1.get_default_graph(), grads, submits)
    return ops.wait_grouped(submits, grads)


def _short_name(v) -> str:
    # the variable's own name without its layer path: layer names carry per-process counters
    # (dense_3) that can differ between ranks that built different throwaway models
    name = str(getattr(v, "name", "var")).split(":")[0]
    return name.rsplit("/", 1)[-1][-40:]
