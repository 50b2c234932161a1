"""DistributedGradientTape, PartialDistributedGradientTape and the gradient reduction behind them
(``reduce_gradients``, which fastxfer.keras's DistributedOptimizer uses too)."""

from __future__ import annotations

import tensorflow as tf

import fastxfer as fx
from fastxfer.tensorflow import ops, overlap
from fastxfer.tensorflow.api import gather_slices, wire_for
from fastxfer.tensorflow.basics import global_process_set, resolve_process_set
from fastxfer.tensorflow.compression import Compression, resolve

# fastxfer's Python builds graphs without data-dependent Python control flow: AutoGraph has nothing
# to convert in it, and converting it call by call made tracing a model's step many times slower
_no_autograph = tf.autograph.experimental.do_not_convert


class LocalVariables:
    """Variables whose gradients stay on their rank (Horovod's register_local_var /
    register_local_source, the Partial* wrappers' local_layers). Layers are kept as layers and
    read when the gradients are reduced, so a layer that builds its weights lazily (on its first
    call) works too."""

    def __init__(self):
        self._vars: list = []  # held, so their ids stay theirs
        self._layers: list = []

    def add_variable(self, var) -> None:
        """A variable (or, for a tape, any watched source) matched by identity."""
        self._vars.append(var)

    def add_layer(self, layer) -> None:
        self._layers.append(layer)

    def __bool__(self):
        return bool(self._vars or self._layers)

    def keys(self) -> set:
        out = set()
        for v in self._vars + [w for layer in self._layers for w in layer.trainable_weights]:
            out |= variable_keys(v)
        return out


def variable_keys(v) -> set:
    """Identities under which a variable may be met: the object, and for a Keras 3 Variable the
    tf.Variable it holds."""
    keys = {id(v)}
    inner = getattr(v, "_value", None)
    if isinstance(inner, tf.Variable):
        keys.add(id(inner))
    return keys


def check_local_layers(local_layers) -> list:
    """Horovod's local_layers argument: a layer or a list of layers (Keras 3 or tf-keras)."""
    if local_layers is None:
        return []
    if _is_layer(local_layers):
        return [local_layers]
    layers = list(local_layers)
    if not all(_is_layer(layer) for layer in layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return layers


def _is_layer(x) -> bool:
    return any(c.__name__ == "Layer" and c.__module__.startswith(("keras.", "tf_keras.", "tensorflow."))
               for c in type(x).__mro__)


class DistributedGradientTape:
    """Wraps a tf.GradientTape: ``gradient()`` averages the gradients across ranks (Horovod's
    arguments; ``device_dense``, ``device_sparse``, ``num_groups`` and ``groups`` are accepted and
    have no effect: the engine fuses gradients into buckets by itself).

    Gradients are submitted last variable first (the order a backward pass produces them, the
    same on every rank), fused by the engine into buckets, and reduced while later gradients are
    still being submitted. ``None`` gradients stay None on every rank (the variable lists must
    match across ranks). Sparse gradients (tf.IndexedSlices, from embedding lookups) are
    allgathered (values and indices), or made dense with ``sparse_as_dense=True``. Gradients of
    sources registered with ``register_local_source`` are not reduced (and are divided by the
    number of ranks when ``scale_local_gradients``, as Horovod does).
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=ops.Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        resolve_process_set(process_set)  # registered, and this rank is in it
        if not isinstance(device_dense, str) or device_dense in ("none", "bf16", "fp16"):
            # fastxfer's tape took compression second before it took Horovod's argument order
            raise TypeError(f"DistributedGradientTape's second argument is device_dense (Horovod's order), not "
                            f"{device_dense!r}: pass compression=... by keyword")
        resolve(compression)  # ValueError now rather than at gradient()
        op = ops.check_op(op)
        if gradient_predivide_factor != 1.0 and op != ops.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._tape = gradtape
        self._compression = compression
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = bool(sparse_as_dense)
        self._local = LocalVariables()
        self.scale_local_gradients = bool(scale_local_gradients)
        self.process_set = process_set

    def __getattr__(self, item):
        return getattr(self._tape, item)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def register_local_source(self, source):
        """The gradient of ``source`` stays on this rank: not reduced (scaled by 1/size when
        ``scale_local_gradients``)."""
        self._local.add_variable(source)

    @_no_autograph
    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kw):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kw)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, flat_sources, op=self._op, compression=self._compression,
                                   gradient_predivide_factor=self._predivide, prefix="DistributedGradientTape",
                                   sparse_as_dense=self._sparse_as_dense, local_variables=self._local,
                                   scale_local_gradients=self.scale_local_gradients, process_set=self.process_set)
        return tf.nest.pack_sequence_as(grads, reduced)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=ops.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape whose ``local_layers`` (a layer or a list of layers) keep their
    gradients on their rank. Their weights are read when ``gradient()`` runs, so layers that are
    built lazily work as well."""
    layers = check_local_layers(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        tape._local.add_layer(layer)
    return tape


@_no_autograph
def reduce_gradients(grads, variables, op=ops.Average, compression=Compression.none, gradient_predivide_factor=1.0,
                     bucket_cap_mb=None, prefix="grad", sparse_as_dense=False, local_variables=None,
                     scale_local_gradients=True, process_set=None):
    """Allreduce a list of gradients (one per variable) the way DistributedGradientTape and
    DistributedOptimizer do: submitted last variable first (the order a backward pass produces
    them), fused by the engine. A None gradient stays None and is not communicated (Keras then
    skips its variable, as it would in one process): every rank must have None for the same
    variables -- they do when every rank runs the same model code -- otherwise the ranks submit
    different requests and all of them raise MismatchError naming the gradient.

    tf.IndexedSlices: made dense with ``sparse_as_dense``, otherwise allgathered (values and
    indices; Average divides the values by the number of ranks). ``local_variables`` (a
    LocalVariables): their gradients are not reduced, and are divided by the number of ranks when
    ``scale_local_gradients`` (Horovod's default). ``compression``: a wire format (built-in) for
    float32 gradients, or a user compressor run around an uncompressed reduction. In a traced
    function each dense submit is pinned into the backward pass when ``overlap.pin_enabled()``."""
    grads = list(grads)
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    op = ops.check_op(op)
    f = float(gradient_predivide_factor)
    if f <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, not {gradient_predivide_factor}")
    wire, user = resolve(compression)
    pre, post = (1.0 / f, f) if op == ops.Average else (1.0, 1.0)
    local = local_variables.keys() if local_variables else set()
    ps = resolve_process_set(process_set)
    size = fx.size() if ps is None else ps.size()
    out = list(grads)
    dense, names, where, sparse = [], [], [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if local and variable_keys(v) & local:
            if scale_local_gradients and size > 1:
                out[i] = _divided(g, size)
            continue
        if isinstance(g, tf.IndexedSlices):
            if not sparse_as_dense:
                sparse.append(i)
                continue
            g = tf.convert_to_tensor(g)
        dense.append(tf.convert_to_tensor(g))
        names.append(f"{prefix}.{i}.{_short_name(v)}")
        where.append(i)
    if dense:
        ctxs = None
        if user is not None:
            pairs = [user.compress(d) for d in dense]
            dense, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
            comps = ["none"] * len(dense)
        else:
            # the engine compresses float32 gradients; others (float16/bfloat16 variables) travel as they are
            comps = [wire_for(d, wire) for d in dense]
        order = list(reversed(range(len(dense))))
        for c in dict.fromkeys(comps):  # one group per wire format, each in backward order
            idx = [j for j in order if comps[j] == c]
            red = _allreduce_group([dense[j] for j in idx], [names[j] for j in idx], op, c, pre, post, bucket_cap_mb,
                                   ps)
            for j, r in zip(idx, red):
                out[where[j]] = user.decompress(r, ctxs[j]) if user is not None else r
    for i in reversed(sparse):  # after the dense submits, last variable first, as they
        name = f"{prefix}.{i}.{_short_name(variables[i])}"
        # Horovod's allgather of values and indices; the predivide factor only splits the
        # averaging of dense sums, the allgathered values are divided by size either way
        out[i] = gather_slices(grads[i], op if op in (ops.Average, ops.Sum) else _sparse_op_error(op),
                               f"{name}.values", f"{name}.indices", ps)
    return out


def _sparse_op_error(op):
    raise NotImplementedError(f"op={op!r}: only Sum and Average ops are supported with tf.IndexedSlices "
                              "(pass sparse_as_dense=True)")


def _divided(g, n: int):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(n, g.values.dtype), g.indices, g.dense_shape)
    g = tf.convert_to_tensor(g)
    return g / tf.cast(n, g.dtype)


def _allreduce_group(grads, names, op, compression, pre, post, bucket_cap_mb, ps=None):
    """grouped_allreduce in list order; traced, with the submits pinned into the backward pass."""
    if tf.executing_eagerly():
        return ops.grouped_allreduce(grads, op=op, compression=compression, prescale_factor=pre, postscale_factor=post,
                                     names=names, bucket_cap_mb=bucket_cap_mb, process_set=ps)
    submits = ops.submit_grouped(grads, names, op, compression, pre, post, bucket_cap_mb=bucket_cap_mb,
                                 process_set=ps)
    if overlap.pin_enabled():
        overlap.pin_to_backward(tf.compat.v1.get_default_graph(), grads, submits)
    return ops.wait_grouped(submits, grads)


def _short_name(v) -> str:
    # the variable's own name without its layer path: layer names carry per-process counters
    # (dense_3) that can differ between ranks that built different throwaway models
    name = str(getattr(v, "name", "var")).split(":")[0]
    return name.rsplit("/", 1)[-1][-40:]
