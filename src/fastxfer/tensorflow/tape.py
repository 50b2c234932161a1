"""DistributedGradientTape, PartialDistributedGradientTape and the gradient reduction behind them:
``GradientReduction`` (how a list of gradients is reduced: its collective options, checked once,
plus what only gradients have) and ``reduce_gradients``, which fastxfer.keras's
DistributedOptimizer uses too."""

from __future__ import annotations

import warnings

import tensorflow as tf

from fastxfer.comm import options, process_sets
from fastxfer.comm.options import CollectiveOptions
from fastxfer.tensorflow import ops, overlap
from fastxfer.tensorflow.basics import global_process_set
from fastxfer.tensorflow.compression import Compression
from fastxfer.tensorflow.errors import tf_errors

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


def _is_variable(v) -> bool:
    return isinstance(v, tf.Variable) or any(
        c.__name__ == "Variable" and c.__module__.startswith(("keras.", "tf_keras.")) for c in type(v).__mro__)


def check_groups(num_groups=0, groups=None):
    """Horovod's ``num_groups=`` / ``groups=``, checked: None (no explicit groups), an int n > 0
    (the gradients cut into n consecutive groups) or a list of lists of variables. ``num_groups``
    is Horovod's deprecated spelling of an int ``groups`` (a DeprecationWarning, as Horovod's);
    giving both is a ValueError here (Horovod silently takes ``groups``)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int, not {num_groups!r}")
    if num_groups != 0:
        if groups is not None:
            raise ValueError("pass num_groups or groups, not both (num_groups=n is the deprecated spelling of groups=n)")
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning, stacklevel=3)
        return num_groups
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups <= 0:
            raise ValueError(f"groups should be a positive integer or a list of lists of tf.Variable, not {groups!r}")
        return groups
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and all(_is_variable(v) for v in g) for g in groups):
        raise ValueError("groups should be a non-negative integer or a list of lists of tf.Variable, not "
                         f"{type(groups).__name__} {groups!r:.200}")
    return [list(g) for g in groups]


def split_list(items: list, n: int) -> list:
    """``items`` cut into ``n`` consecutive pieces as even as possible, the first (len mod n) one
    longer (Horovod's rule for num_groups); pieces may be empty when n > len(items)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def explicit_groups(groups, candidates: list, variables) -> list:
    """Horovod's explicit groups of the gradients at indexes ``candidates`` (not None, not local;
    in variable order): ``groups`` an int n -- the candidates cut into n consecutive pieces; a
    list of lists of variables -- each list one group (its candidates, in variable order), and
    every candidate in no list a group of its own, after them. Empty groups are dropped."""
    if isinstance(groups, int):
        return [g for g in split_list(candidates, groups) if g]
    where = {}
    for k, group in enumerate(groups):
        for v in group:
            for key in variable_keys(v):
                where.setdefault(key, k)
    listed = [[] for _ in groups]
    alone = []
    for i in candidates:
        k = next((where[key] for key in variable_keys(variables[i]) if key in where), None)
        if k is None:
            alone.append([i])
        else:
            listed[k].append(i)
    return [g for g in listed if g] + alone


class GradientReduction:
    """How DistributedGradientTape and DistributedOptimizer reduce a list of gradients: ``opts``
    (the allreduce's options, with a predivide factor as its pre- and postscale), whether sparse
    gradients are made dense, the variables whose gradients stay local and whether those are
    divided by the number of ranks, the prefix of the gradients' names, and Horovod's explicit
    ``groups`` (check_groups: None, an int, or lists of variables), each group reduced as one
    fusion unit."""

    __slots__ = ("opts", "sparse_as_dense", "local", "scale_local_gradients", "prefix", "groups")

    def __init__(self, opts: CollectiveOptions, sparse_as_dense=False, local=None, scale_local_gradients=True,
                 prefix="grad", groups=None):
        self.opts = opts
        self.sparse_as_dense = bool(sparse_as_dense)
        self.local = LocalVariables() if local is None else local
        self.scale_local_gradients = bool(scale_local_gradients)
        self.prefix = prefix
        self.groups = groups


@tf_errors
def gradient_options(op=ops.Average, compression=Compression.none, gradient_predivide_factor=1.0,
                     bucket_cap_mb=None, process_set=None) -> CollectiveOptions:
    """The allreduce options of a gradient reduction (``op`` None: Average). A predivide factor f
    divides by f before the sum and by size/f after it: prescale 1/f, postscale f, and the
    engine's 1/size of an average."""
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)) \
            or not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, not {gradient_predivide_factor!r}")
    f = float(gradient_predivide_factor)
    op = options.check_op(ops.Average if op is None else op)
    if f != 1.0 and op != ops.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    pre, post = (1.0 / f, f) if f != 1.0 else (1.0, 1.0)
    # a set this rank is not in is allowed: reduce_gradients leaves such a rank's gradients alone
    return options.allreduce(op, compression, pre, post, bucket_cap_mb, process_set, compressors=True,
                             members_only=False)


class DistributedGradientTape:
    """Wraps a tf.GradientTape: ``gradient()`` averages the gradients across ranks (Horovod's
    arguments; ``device_dense`` and ``device_sparse`` are accepted and have no effect).

    ``groups=n`` (or the deprecated ``num_groups=n``) cuts the gradients, in variable order, into
    n consecutive groups (Horovod's split); ``groups=[[v, ...], ...]`` makes each list of
    variables a group, every other variable a group of its own. Each group is one fusion unit:
    its submits are held until its last one, and no bucket holds tensors of two groups (a group
    larger than the bucket cap still takes several buckets). Without groups the engine fuses
    gradients into buckets by itself.

    Gradients are submitted last variable first (the order a backward pass produces them, the
    same on every rank), fused by the engine into buckets, and reduced while later gradients are
    still being submitted. ``None`` gradients stay None on every rank (the variable lists must
    match across ranks). Sparse gradients (tf.IndexedSlices, from embedding lookups) are
    allgathered (values and indices), or made dense with ``sparse_as_dense=True``. Gradients of
    sources registered with ``register_local_source`` are not reduced (and are divided by the
    number of ranks when ``scale_local_gradients``, as Horovod does). With ``process_set``, the
    set's ranks average among themselves and a rank outside the set gets its gradients back as
    they are, unreduced (Horovod's rule).
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=ops.Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        if not isinstance(device_dense, str) or device_dense in ("none", "bf16", "fp16"):
            # fastxfer's tape took compression second before it took Horovod's argument order
            raise TypeError(f"DistributedGradientTape's second argument is device_dense (Horovod's order), not "
                            f"{device_dense!r}: pass compression=... by keyword")
        self._tape = gradtape
        self._reduction = GradientReduction(gradient_options(op, compression, gradient_predivide_factor, None,
                                                             process_set),
                                            sparse_as_dense, scale_local_gradients=scale_local_gradients,
                                            prefix="DistributedGradientTape", groups=check_groups(num_groups, groups))
        self.process_set = process_set

    @property
    def scale_local_gradients(self) -> bool:
        return self._reduction.scale_local_gradients

    @scale_local_gradients.setter
    def scale_local_gradients(self, value) -> None:
        self._reduction.scale_local_gradients = bool(value)

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
        self._reduction.local.add_variable(source)

    def add_local_layer(self, layer):
        """``layer``'s gradients stay on this rank (PartialDistributedGradientTape's local_layers)."""
        self._reduction.local.add_layer(layer)

    @_no_autograph
    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kw):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kw)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, flat_sources, self._reduction)
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
        tape.add_local_layer(layer)
    return tape


@_no_autograph
@tf_errors
def reduce_gradients(grads, variables, reduction: GradientReduction) -> list:
    """Allreduce a list of gradients (one per variable) the way DistributedGradientTape and
    DistributedOptimizer do: submitted last variable first (the order a backward pass produces
    them), fused by the engine. A None gradient stays None and is not communicated (Keras then
    skips its variable, as it would in one process): every rank must have None for the same
    variables -- they do when every rank runs the same model code -- otherwise the ranks submit
    different requests and all of them raise MismatchError naming the gradient.

    tf.IndexedSlices: made dense with ``reduction.sparse_as_dense``, otherwise allgathered (values
    and indices; Average divides the values by the number of ranks). Gradients of
    ``reduction.local`` variables are not reduced, and are divided by the number of ranks when
    ``reduction.scale_local_gradients`` (Horovod's default). In a traced function each dense
    submit is pinned into the backward pass when ``overlap.pin_enabled()``.

    On a rank that is not in ``reduction.opts.process_set`` the gradients come back as they are,
    unreduced (Horovod's rule: only the set's ranks reduce; the others go on with their own).
    A set removed since the options were made raises ProcessSetRemovedError naming its id."""
    grads = list(grads)
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    ps = reduction.opts.process_set
    if ps is not None and not process_sets.resolve(ps, members_only=False).included():
        return grads
    opts, prefix = reduction.opts, reduction.prefix
    local = reduction.local.keys() if reduction.local else set()
    size = opts.size
    out = list(grads)
    candidates = [i for i, (g, v) in enumerate(zip(grads, variables))
                  if g is not None and not (local and variable_keys(v) & local)]
    group_of = {}
    if reduction.groups is not None:
        for k, group in enumerate(explicit_groups(reduction.groups, candidates, variables)):
            for i in group:
                group_of[i] = k
    dense, names, where, sparse = [], [], [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if local and variable_keys(v) & local:
            if reduction.scale_local_gradients and size > 1:
                out[i] = _divided(g, size)
            continue
        if isinstance(g, tf.IndexedSlices):
            if not reduction.sparse_as_dense:
                sparse.append(i)
                continue
            g = tf.convert_to_tensor(g)
        dense.append(tf.convert_to_tensor(g))
        # a grouped gradient's name carries its group: ranks that group differently submit
        # different names and fail with MismatchError instead of fusing differently
        k = group_of.get(i)
        names.append(f"{prefix}.{i}.{_short_name(v)}" if k is None else f"{prefix}.g{k}.{i}.{_short_name(v)}")
        where.append(i)
    if dense:
        groups = None
        if group_of:
            # by group, the group of the last variables first, each last variable first (a
            # backward pass's order); positions in `dense`
            pos = {i: j for j, i in enumerate(where)}
            by_group = {}
            for i in where:
                by_group.setdefault(group_of[i], []).append(pos[i])
            groups = sorted((sorted(g, reverse=True) for g in by_group.values()), key=lambda g: -g[0])
        for j, r in zip(where, _allreduce_backward(dense, names, opts, groups)):
            out[j] = r
    for i in reversed(sparse):  # after the dense submits, last variable first, as they
        name = f"{prefix}.{i}.{_short_name(variables[i])}"
        # Horovod's allgather of values and indices; the predivide factor only splits the
        # averaging of dense sums, the allgathered values are divided by size either way
        out[i] = ops.gather_slices(grads[i], opts.op, opts, f"{name}.values", f"{name}.indices")
    return out


def _divided(g, n: int):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(n, g.values.dtype), g.indices, g.dense_shape)
    g = tf.convert_to_tensor(g)
    return g / tf.cast(n, g.dtype)


def _allreduce_backward(grads, names, opts: CollectiveOptions, groups=None) -> list:
    """The gradients' grouped allreduce, submitted last gradient first (or by ``groups``: lists of
    indexes, each one fusion group, in submission order); traced, with the submits pinned into the
    backward pass. A user compressor runs around the reduction."""
    order = [i for g in groups for i in g] if groups is not None else list(reversed(range(len(grads))))
    if tf.executing_eagerly() or opts.compressor is not None:
        return ops.grouped_allreduce(grads, opts, names, order, groups)
    pending = ops.submit_grouped(grads, opts, names, order, groups)
    if overlap.pin_enabled():
        overlap.pin_to_backward(tf.compat.v1.get_default_graph(), grads, [p.handle for p in pending])
    return ops.wait_grouped(pending)


def _short_name(v) -> str:
    # the variable's own name without its layer path: layer names carry per-process counters
    # (dense_3) that can differ between ranks that built different throwaway models
    name = str(getattr(v, "name", "var")).split(":")[0]
    return name.rsplit("/", 1)[-1][-40:]
