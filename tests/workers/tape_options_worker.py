"""Worker for tests/multiproc/test_tape_options.py (started by `fastxfer run`): Horovod's optimizer
and tape options with exact values -- explicit fusion groups (groups=, num_groups=; the test reads
the buckets from the timeline), backward_passes_per_step with sparse_as_dense and mixed precision,
SyncBatchNormalization in model.fit's graph, and local (non-reduced) variables. MODE[,MODE...]:
several checks share one job; TF_USE_LEGACY_KERAS=1 (set by the test) runs the Keras ones on tf-keras."""

import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer.tensorflow as hvd  # noqa: E402

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
if LEGACY:
    import tf_keras as keras  # noqa: E402

    from fastxfer.tensorflow.sync_batch_norm import tf_keras_sync_batch_normalization  # noqa: E402

    SyncBN = tf_keras_sync_batch_normalization()
else:
    import keras  # noqa: E402

    from fastxfer.keras import SyncBatchNormalization as SyncBN  # noqa: E402

KIND = "tf-keras" if LEGACY else "keras3"


def expect_value_error(fn, words):
    try:
        fn()
    except ValueError as e:
        assert words in str(e), (words, str(e))
        return
    raise AssertionError(f"no ValueError ({words})")


def tape_groups():
    """Gradients of named variables through tapes with groups; the test finds each group in one
    bucket of its own on the timeline (and the ungrouped control variables all in one)."""
    r, n = hvd.rank(), hvd.size()
    v = tf.Variable(tf.zeros(4))
    with tf.GradientTape() as t:
        pass
    for kw, words in [({"num_groups": -1}, "non-negative int"), ({"num_groups": 1.5}, "non-negative int"),
                      ({"groups": 0}, "positive integer"), ({"groups": "ab"}, "list of lists of tf.Variable"),
                      ({"groups": [[1, 2]]}, "list of lists of tf.Variable"),
                      ({"groups": [v]}, "list of lists of tf.Variable"),
                      ({"num_groups": 2, "groups": [[v]]}, "not both")]:
        expect_value_error(lambda: hvd.DistributedGradientTape(t, **kw), words)

    def variables(prefix):
        return [tf.Variable(tf.zeros(4), name=f"{prefix}{k}") for k in range(4)]

    def loss(vs):  # d loss / d vs[k] = (r + 1) * (k + 1): the average over ranks is (k + 1) * (n + 1) / 2
        return tf.add_n([tf.reduce_sum(x) * float((r + 1) * (k + 1)) for k, x in enumerate(vs)])

    def check(grads, what):
        for k, g in enumerate(grads):
            want = np.full(4, (k + 1) * (n + 1) / 2, np.float32)
            assert np.array_equal(g.numpy(), want), (what, k, g.numpy(), want)

    ga, gb, gc = variables("ga"), variables("gb"), variables("gc")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # eager, num_groups=2: {ga0, ga1} and {ga2, ga3}
            with tf.GradientTape() as t:
                y = loss(ga)
            check(hvd.DistributedGradientTape(t, num_groups=2).gradient(y, ga), "num_groups eager")
    assert any(issubclass(w.category, DeprecationWarning) and "num_groups" in str(w.message) for w in caught)

    @tf.function
    def step():  # traced, groups of variables: {gb0, gb2}, {gb1}; gb3 is in no list, a group of its own
        with tf.GradientTape() as t:
            y = loss(gb)
        return hvd.DistributedGradientTape(t, groups=[[gb[0], gb[2]], [gb[1]]]).gradient(y, gb)

    for _ in range(2):
        check(step(), "groups tf.function")
    for _ in range(2):  # the control: no groups, one held run, one bucket
        with tf.GradientTape() as t:
            y = loss(gc)
        check(hvd.DistributedGradientTape(t).gradient(y, gc), "no groups")

    @tf.function
    def two_lists(a, b):  # Horovod's grouped_allreduce: each list one group, even when both are queued at once
        return (hvd.grouped_allreduce([a, 2 * a], op=hvd.Sum, names=["t.gd0", "t.gd1"]),
                hvd.grouped_allreduce([b, 2 * b], op=hvd.Sum, names=["t.gd2", "t.gd3"]))

    for _ in range(2):
        (x0, x1), (x2, x3) = two_lists(tf.fill([4], float(r)), tf.fill([4], float(r + 10)))
        for got, want in [(x0, n * (n - 1) / 2), (x1, n * (n - 1)), (x2, n * (n - 1) / 2 + 10 * n),
                          (x3, n * (n - 1) + 20 * n)]:
            assert np.array_equal(got.numpy(), np.full(4, want, np.float32)), (got.numpy(), want)
    print(f"OK tape_groups rank {r}", flush=True)


def optimizer_groups():
    """DistributedOptimizer(groups=[[...]]) in model.fit: exact weights, and validation."""
    r, n = hvd.rank(), hvd.size()
    expect_value_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), groups=[["kernel"]]),
                       "list of lists of tf.Variable")
    expect_value_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), num_groups=-2),
                       "non-negative int")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, kernel_initializer="ones", name="og1"),
                              keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False, name="og2")])
    l1, l2 = model.layers
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), groups=[[l1.kernel, l2.kernel]])  # l1.bias: alone
    model.compile(optimizer=opt, loss="mse")
    x = np.array([[1.0, 2.0]], np.float32) * (r + 1)
    model.fit(x, 4 * x[:, :1], batch_size=1, epochs=1, verbose=0, shuffle=False)
    # h = x @ 1 = 3 (r + 1) per unit, out = h @ 0 = 0, y = 4 (r + 1): d/d og2 = 2 (out - y) h = -24 (r + 1)^2;
    # og1's gradients pass through og2's zero kernel: 0
    want2 = 0.5 * np.mean([24.0 * (q + 1) ** 2 for q in range(n)])
    assert np.array_equal(l2.kernel.numpy(), np.full((3, 1), want2, np.float32)), l2.kernel.numpy()
    assert np.array_equal(l1.kernel.numpy(), np.ones((2, 3), np.float32)), l1.kernel.numpy()
    # a second model whose gradients do not vanish: out = x @ k, loss = mse -> dk = 2 * (x k - y) x
    m2 = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                                 name="oga"),
                           keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="ogb")])
    a, b = m2.layers
    opt2 = hvd.DistributedOptimizer(keras.optimizers.SGD(0.25), num_groups=2)
    m2.compile(optimizer=opt2, loss="mse")
    y2 = np.array([[4.0]], np.float32) * (r + 1)
    m2.fit(x, y2, batch_size=1, epochs=1, verbose=0, shuffle=False)
    # out = 0; d out/d a = x * b = x; d loss/d a = 2 (0 - y) x; d loss/d b = 2 (0 - y) * (x a) = 0
    ga = np.mean([2 * (0 - 4.0 * (q + 1)) * np.array([1.0, 2.0]) * (q + 1) for q in range(n)], axis=0)
    assert np.array_equal(a.kernel.numpy()[:, 0], (-0.25 * ga).astype(np.float32)), (a.kernel.numpy(), ga)
    assert np.array_equal(b.kernel.numpy(), np.ones((1, 1), np.float32)), b.kernel.numpy()
    print(f"OK optimizer_groups {KIND} rank {r}", flush=True)


def _embedding_model(mixed):
    if mixed:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential([keras.Input((2,), dtype="int32"),
                                  keras.layers.Embedding(5, 1, embeddings_initializer="zeros"),
                                  keras.layers.Flatten()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def _sum_loss(y_true, y_pred):  # per sample: the sum of its two embedding values
    return tf.reduce_sum(tf.cast(y_pred, tf.float32), axis=-1) + 0.0 * tf.reduce_sum(tf.cast(y_true, tf.float32), axis=-1)


def _ids(q, batches, bs):
    rng = np.random.default_rng(40 + q)
    return rng.integers(0, 5, (batches * bs, 2)).astype(np.int32)


def bpps():
    """backward_passes_per_step=2 on an Embedding model: sparse (allgathered) and sparse_as_dense,
    average_aggregated_gradients False/True, float32 and mixed_bfloat16 -- exact weights after 4
    batches (2 applies), computed from every rank's ids."""
    r, n = hvd.rank(), hvd.size()
    batches, bs, lr, k = 4, 4, 1.0, 2
    for sparse_as_dense in (True, False):
        for average in (False, True):
            for mixed in (False, True):
                model = _embedding_model(mixed)
                opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=k,
                                               average_aggregated_gradients=average, sparse_as_dense=sparse_as_dense)
                model.compile(optimizer=opt, loss=_sum_loss)
                ids = _ids(r, batches, bs)
                model.fit(ids, np.zeros((len(ids), 2), np.float32), batch_size=bs, epochs=1, verbose=0, shuffle=False)
                # per batch and rank: d loss / d row j = count of j in the batch / bs; averaged over ranks
                want = np.zeros(5)
                for b in range(batches):
                    g = np.mean([np.bincount(_ids(q, batches, bs)[b * bs:(b + 1) * bs].ravel(), minlength=5) / bs
                                 for q in range(n)], axis=0)
                    want -= lr * g / (k if average else 1)  # both passes of each pair are applied (4 = 2 pairs)
                got = model.layers[0].embeddings.numpy()[:, 0]
                assert np.array_equal(got, want.astype(np.float32)), (sparse_as_dense, average, mixed, got, want)
    # k passes of batch B with averaging equal one pass of batch k * B
    model = _embedding_model(False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)), loss=_sum_loss)
    ids = _ids(r, batches, bs)
    model.fit(ids, np.zeros((len(ids), 2), np.float32), batch_size=2 * bs, epochs=1, verbose=0, shuffle=False)
    one = model.layers[0].embeddings.numpy()[:, 0]
    model = _embedding_model(False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=2,
                                                     average_aggregated_gradients=True), loss=_sum_loss)
    model.fit(ids, np.zeros((len(ids), 2), np.float32), batch_size=bs, epochs=1, verbose=0, shuffle=False)
    assert np.array_equal(model.layers[0].embeddings.numpy()[:, 0], one)
    # mixed_float16's loss scaling decides per step whether to apply: refused with accumulation
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        expect_value_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=2),
                           "loss scaling")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"OK bpps {KIND} rank {r}", flush=True)


def syncbn():
    """SyncBatchNormalization in model.fit's traced step, different batches (and batch sizes) per
    rank: momentum 0 makes the moving statistics the global batch's mean and (biased) variance."""
    r, n = hvd.rank(), hvd.size()

    def data(q):
        return (np.arange((q + 2) * 3, dtype=np.float32).reshape(q + 2, 3) * (q + 1) + 4 * q) / 4

    eps = 1e-3
    model = keras.Sequential([keras.Input((3,)), SyncBN(momentum=0.0, epsilon=eps)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    x = data(r)
    model.fit(x, np.zeros_like(x), batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    everything = np.concatenate([data(q) for q in range(n)]).astype(np.float64)
    bn = model.layers[0]
    mean, var = everything.mean(axis=0), everything.var(axis=0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, rtol=1e-5)
    # the layer's training output on this rank: normalised with the global moments
    out = model(x, training=True).numpy()
    np.testing.assert_allclose(out, (x - mean) / np.sqrt(var + eps), rtol=1e-5, atol=1e-5)
    print(f"OK syncbn {KIND} rank {r}", flush=True)


def local_vars():
    """Local variables: their gradients stay on the rank (divided by the number of ranks, Horovod's
    scale_local_gradients default), the others are averaged; tape and optimizer, eager and traced."""
    r, n = hvd.rank(), hvd.size()
    shared, mine = tf.Variable([1.0, 2.0]), tf.Variable([3.0, 4.0])
    c = float(r + 1)

    def grads(scale, traced):
        def run():
            with tf.GradientTape() as t:
                y = tf.reduce_sum(shared * c) + tf.reduce_sum(mine * c * 2)
            tape = hvd.DistributedGradientTape(t, scale_local_gradients=scale)
            tape.register_local_source(mine)
            return tape.gradient(y, [shared, mine])
        return tf.function(run)() if traced else run()

    for traced in (False, True):
        for scale in (True, False):
            gs, gm = grads(scale, traced)
            assert np.array_equal(gs.numpy(), np.full(2, (n + 1) / 2, np.float32)), gs.numpy()
            assert np.array_equal(gm.numpy(), np.full(2, 2 * c / (n if scale else 1), np.float32)), gm.numpy()
    # PartialDistributedOptimizer in model.fit: the local layer's kernel moves by this rank's gradient / n
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                                                    name="shared_dense"),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="local_dense")])
    s, loc = model.layers
    from fastxfer.tensorflow.keras_optimizer import PartialDistributedOptimizer

    opt = PartialDistributedOptimizer(keras.optimizers.SGD(0.125), local_layers=[loc])
    model.compile(optimizer=opt, loss="mse")
    xs = [1.0, 2.0, 4.0]  # the average of 2 x^2 is exact on 2 and on 3 ranks (5, 14)
    c = xs[r]
    x, y = np.array([[c]], np.float32), np.zeros((1, 1), np.float32)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False)
    # out = x * s * l = c; d/ds = 2 c * c * l = 2 c^2 ; d/dl = 2 c * c * s = 2 c^2
    avg = np.mean([2 * xs[q] ** 2 for q in range(n)])
    f32 = np.float32
    assert np.array_equal(s.kernel.numpy(), np.array([[1 - 0.125 * avg]], f32)), s.kernel.numpy()
    want = f32(1) - f32(0.125) * (f32(2 * c * c) / f32(n))  # float32, as TensorFlow divides and steps
    assert np.array_equal(loc.kernel.numpy(), np.array([[want]], f32)), (loc.kernel.numpy(), want)
    # register_local_var on a DistributedOptimizer, scale_local_gradients=False: the raw local gradient
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
    s, loc = model.layers
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.125), scale_local_gradients=False)
    model.compile(optimizer=opt, loss="mse")
    model.build((None, 1))
    opt.register_local_var(loc.kernel)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False)
    assert np.array_equal(s.kernel.numpy(), np.array([[1 - 0.125 * avg]], np.float32)), s.kernel.numpy()
    assert np.array_equal(loc.kernel.numpy(), np.array([[1 - 0.125 * 2 * c * c]], np.float32)), loc.kernel.numpy()
    print(f"OK local_vars {KIND} rank {r}", flush=True)


if __name__ == "__main__":
    hvd.init()
    modes = {"tape_groups": tape_groups, "optimizer_groups": optimizer_groups, "bpps": bpps, "syncbn": syncbn,
             "local_vars": local_vars}
    for what in sys.argv[1].split(","):
        modes[what]()
    hvd.shutdown()  # writes the timeline, when the test asked for one
