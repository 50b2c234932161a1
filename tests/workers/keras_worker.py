"""Worker for tests/test_keras.py (started by `fastxfer run`). Each mode trains with
fastxfer.keras on N ranks and compares with one process training on the concatenated batch."""

import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if LEGACY:
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

import fastxfer.keras as hvd  # noqa: E402

B, STEPS, D = 8, 6, 5


def data(n):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * n * B, D)).astype(np.float32)
    y = (x @ rng.standard_normal((D, 3)) + 0.3).astype(np.float32)
    return x, y


def shard(a, r, n, b=B):
    """Rank r's part of every global batch of n*b rows."""
    return a.reshape(-1, n, b, *a.shape[1:])[:, r].reshape(-1, *a.shape[1:])


def mlp(seed, bn=None):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((D,))]
    if bn is not None:
        layers.append(bn())  # straight on the inputs, so the test can give them a large mean
    layers.append(keras.layers.Dense(16, activation="tanh"))
    layers += [keras.layers.Dense(3)]
    return keras.Sequential(layers)


def flat(model):
    return np.concatenate([np.asarray(v.numpy() if hasattr(v, "numpy") else v).astype(np.float64).ravel()
                           for v in model.variables])


def same_on_all_ranks(vec):
    everyone = hvd.allgather(tf.constant(vec[None])).numpy()
    return bool((everyone == everyone[0]).all())


def set_policy(name):
    if LEGACY:
        keras.mixed_precision.set_global_policy(name)
    else:
        keras.mixed_precision.set_dtype_policy(name)


def fit_mode(mode):
    """mode: graph | eager | jit | bf16comm | mixed_bfloat16 | mixed_float16 | accum"""
    r, n = hvd.rank(), hvd.size()
    k = 3 if mode == "accum" else 1
    x, y = data(n * k)
    policy = mode if mode.startswith("mixed_") else "float32"
    set_policy(policy)
    model = mlp(100 + r)  # different initial weights on every rank: the callback must fix that
    ref = mlp(100)  # rank 0's initial weights
    kw = dict(compression=hvd.Compression.bf16 if mode == "bf16comm" else hvd.Compression.none)
    if mode == "accum":
        kw.update(backward_passes_per_step=k, average_aggregated_gradients=True)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5), **kw)
    compile_kw = {}
    if mode == "eager":
        compile_kw["run_eagerly"] = True
    if mode == "jit":
        compile_kw["jit_compile"] = True
    model.compile(optimizer=opt, loss="mse", **compile_kw)
    model.fit(shard(x, r, n), shard(y, r, n), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    mine = flat(model)
    assert same_on_all_ranks(mine), f"{mode}: weights differ between ranks"
    # one process, batch n*B*k, plain optimizer, same start
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    ref.fit(x, y, batch_size=n * B * k, epochs=1, shuffle=False, verbose=0)
    want = flat(ref)
    err = float(np.max(np.abs(mine - want) / (np.abs(want) + 1)))
    # float32: only the summation order differs. bf16 on the wire: each gradient rounded to 8
    # significant bits twice (relative error <= 2^-8 per step), over 6 steps: < 1e-2 relative
    # to the weights' scale. Mixed precision: the forward pass runs in 16 bits on batches of
    # different sizes (different kernels, different rounding): 2e-2.
    tol = {"bf16comm": 1e-2, "mixed_bfloat16": 2e-2, "mixed_float16": 2e-2}.get(mode, 2e-5)
    assert err < tol, f"{mode}: max relative difference {err:.3g} from one process on the whole batch (tol {tol})"
    if mode == "mixed_float16" and not LEGACY:
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    set_policy("float32")
    print(f"OK fit {mode} rank {r} err {err:.2e}", flush=True)


def none_grads():
    """A variable without a gradient on every rank is skipped as in one process (unchanged); one
    without a gradient on some ranks only makes every rank raise MismatchError naming it."""
    r, n = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(5)
    main = keras.layers.Dense(3, name="main")
    unused = keras.layers.Dense(3, name="unused")
    side = keras.layers.Dense(3, name="side")

    class Model(keras.Model):
        def __init__(self, asymmetric):
            super().__init__()
            self.main, self.unused, self.side, self.asymmetric = main, unused, side, asymmetric

        def call(self, x):
            y = self.main(x)
            if self.asymmetric and r == 0:
                y = y + self.side(x)
            return y

    x, y = data(n)
    model = Model(False)
    model(np.zeros((1, D), np.float32))
    unused(np.zeros((1, D), np.float32))
    side(np.zeros((1, D), np.float32))
    before = unused.kernel.numpy().copy()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras warns that some variables have no gradient
        model.fit(shard(x, r, n), shard(y, r, n), batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert same_on_all_ranks(flat(model)), "weights differ between ranks"
    assert np.array_equal(unused.kernel.numpy(), hvd.broadcast(tf.constant(before), 0).numpy()), \
        "a variable without gradient changed"
    t = hvd.oob_allreduce(tf.constant([float(r), 1.0]), op=hvd.Sum)
    assert t.numpy().tolist() == [n * (n - 1) / 2, float(n)]
    bad = Model(True)
    bad(np.zeros((1, D), np.float32))
    bad.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad.fit(shard(x, r, n), shard(y, r, n), batch_size=B, epochs=1, shuffle=False, verbose=0)
    except Exception as e:
        assert "MismatchError" in str(e), str(e)
        print(f"OK nonegrads rank {r}", flush=True)
        return
    raise AssertionError("a rank-dependent None gradient trained without an error")


def overlap():
    """Gradients reach the engine during the backward pass: when the backward pass gets to the
    first layer, the gradients of all the layers above it have been submitted, in every step."""
    import fastxfer.tensorflow as ftf

    r = hvd.rank()
    seen = []

    def record(x):
        seen.append(ftf.submitted)
        return x

    @tf.custom_gradient
    def probe(x):
        def grad(dy):
            # stateless: TensorFlow runs stateful host callbacks in program order, which would put
            # this probe (created by tape.gradient) before the optimizer's submits regardless
            return tf.numpy_function(record, [dy], dy.dtype, stateful=False)
        return tf.identity(x), grad

    keras.utils.set_random_seed(3)
    inp = keras.Input((64,))
    h = keras.layers.Dense(256, activation="relu")(inp)
    h = keras.layers.Lambda(probe)(h)  # its gradient runs after the 5 layers above it, before the first
    for _ in range(4):
        h = keras.layers.Dense(256, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x = np.random.default_rng(r).standard_normal((64 * 6, 64)).astype(np.float32)
    model.fit(x, np.zeros((64 * 6, 4), np.float32), batch_size=64, epochs=1, shuffle=False, verbose=0)
    # submitted before the probe in step s: s*12 from earlier steps + this step's 10 gradients of
    # the 5 upper layers; gradients sent after the backward pass would give s*12
    early = [seen[s] - s * 12 for s in range(len(seen))]
    assert early == [10] * 6, f"gradients were not all submitted during the backward pass: {early}"
    print(f"OK overlap rank {r}", flush=True)


def syncbn():
    r, n = hvd.rank(), hvd.size()
    x, y = data(n)
    x = x * 0.5 + 300.0  # |mean| >> std: E[x^2] - E[x]^2 in float32 would lose the variance
    model = mlp(7, bn=lambda: hvd.SyncBatchNormalization(momentum=0.8))
    ref = mlp(7, bn=lambda: keras.layers.BatchNormalization(momentum=0.8))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(shard(x, r, n), shard(y, r, n), batch_size=B, epochs=1, shuffle=False, verbose=0)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
    mine, want = flat(model), flat(ref)  # includes moving mean and variance
    assert same_on_all_ranks(mine), "SyncBatchNormalization: weights differ between ranks"
    err = float(np.max(np.abs(mine - want) / (np.abs(want) + 1)))
    assert err < 5e-5, f"SyncBatchNormalization differs from BatchNormalization on the whole batch: {err:.3g}"
    # and it really synchronises: plain BatchNormalization on the shards ends elsewhere
    plain = mlp(7, bn=lambda: keras.layers.BatchNormalization(momentum=0.8))
    plain.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    plain.fit(shard(x, r, n), shard(y, r, n), batch_size=B, epochs=1, shuffle=False, verbose=0)
    other = float(np.max(np.abs(flat(plain) - want) / (np.abs(want) + 1)))
    assert other > 100 * max(err, 1e-7), f"per-rank batch norm should differ (got {other:.3g})"
    print(f"OK syncbn rank {r} err {err:.2e} unsynced {other:.2e}", flush=True)


def callbacks_mode(ckdir):
    r, n = hvd.rank(), hvd.size()
    x, y = data(n)
    model = mlp(3 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    seen = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen[epoch] = dict(logs)

    warm = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=STEPS)
    lrs = []

    class LR(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    ck = hvd.callbacks.ModelCheckpoint(os.path.join(ckdir, "model.keras"))
    model.fit(shard(x, r, n), shard(y, r, n) + r, batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                         warm, LR(), Record(), ck])
    # warm-up: Horovod's formula, batch by batch (shifted by 1/steps, as Horovod's code: the last
    # warm-up batch runs at the full rate), then the rate is left alone
    want = [warm.lr_at(e + b / STEPS) if e < 2 else 0.1 for e in range(3) for b in range(STEPS)]
    np.testing.assert_allclose(lrs, want, rtol=1e-6)
    assert abs(want[0] - 0.1 / n * (1 + (n - 1) / (2 * STEPS))) < 1e-9 and abs(want[2 * STEPS - 1] - 0.1) < 1e-12
    # averaged metrics: identical on every rank, and equal to the mean of the local losses
    loss = np.array([seen[e]["loss"] for e in range(3)])
    assert same_on_all_ranks(loss), "MetricAverageCallback: ranks disagree"
    assert same_on_all_ranks(flat(model)), "weights differ between ranks"
    hvd.allreduce(tf.constant(0.0))  # everyone done writing
    files = sorted(os.listdir(ckdir))
    assert files == ["model.keras"], files
    print(f"OK callbacks rank {r}", flush=True)


def mismatch():
    r = hvd.rank()
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(4 + r)])  # ranks disagree on a shape
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.ones((B, D), np.float32)
    try:
        model.fit(x, np.ones((B, 4 + r), np.float32), batch_size=B, verbose=0)
    except Exception as e:  # inside model.fit TensorFlow re-raises it as an op error carrying the message
        msg = str(e)
        # each variable's allreduce fails alone; TensorFlow reports whichever op failed first
        assert "MismatchError" in msg and re.search(r"float32\[(D,)?4\].*float32\[(D,)?5\]".replace("D", str(D)),
                                                    msg), msg
        print(f"OK mismatch rank {r}: " + msg[msg.index("MismatchError"):].splitlines()[0], flush=True)
        return
    raise AssertionError("ranks with different models trained without an error")


def averaging():
    from fastxfer.keras.callbacks import average_variables

    r, n = hvd.rank(), hvd.size()
    v = keras.Variable(np.full((3, 2), float(r), np.float32))
    c = keras.Variable(np.array(7 + r, np.int64))  # non-float: left alone
    average_variables([v, c], "t")
    assert np.array_equal(v.numpy(), np.full((3, 2), (n - 1) / 2, np.float32)) and int(c.numpy()) == 7 + r
    x, y = data(n)
    model = mlp(11 + r)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")  # local SGD: plain optimizer
    cb = hvd.callbacks.ModelAveragingCallback(every_n_steps=4)
    model.fit(shard(x, r, n), shard(y, r, n) * (1 + r), batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), cb])
    assert cb.averages == 3, cb.averages  # after steps 4, 8, 12 (= the last step: no extra average at the end)
    assert same_on_all_ranks(flat(model)), "weights differ after averaging"
    print(f"OK averaging rank {r}", flush=True)


def earlystop():
    r, n = hvd.rank(), hvd.size()
    x, y = data(n)
    model = mlp(1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")

    class Score(keras.callbacks.Callback):  # rank 0 alone would keep improving; the average worsens
        def on_epoch_end(self, epoch, logs=None):
            logs["score"] = 1.0 - 0.1 * epoch if r == 0 else 1.0 + 1.0 * epoch

    stop = hvd.callbacks.EarlyStopping(monitor="score", mode="min", patience=1)
    hist = model.fit(shard(x, r, n), shard(y, r, n), batch_size=B, epochs=20, shuffle=False, verbose=0,
                     callbacks=[Score(), stop])
    epochs = len(hist.history["loss"])
    assert epochs == 2, epochs  # best at epoch 0 (average 1.0), worse at epoch 1: patience 1 stops there
    print(f"OK earlystop rank {r} epochs {epochs}", flush=True)


def bucketcap():
    """Per-request bucket caps: exact results with several caps; ranks that disagree -> MismatchError."""
    import fastxfer as fx

    r, n = hvd.rank(), hvd.size()
    xs = [np.arange(300_000, dtype=np.float32) * (i + 1) + r for i in range(5)]  # 1.2 MB each
    for cap in (0.25, 1.0, 64.0):
        hs = [fx.allreduce_async(x, op="sum", name=f"cap{cap}.{i}", bucket_cap_mb=cap) for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            want = np.arange(300_000, dtype=np.float32) * (i + 1) * n + sum(range(n))
            assert np.array_equal(h.wait(), want), (cap, i)
    try:
        fx.allreduce(xs[0], op="sum", name="disagree", bucket_cap_mb=1.0 + r)
    except fx.MismatchError as e:
        assert "bucket_cap" in str(e), str(e)
        print(f"OK bucketcap rank {r}", flush=True)
        return
    raise AssertionError("ranks with different bucket caps reduced without an error")


# scenario -> function of its one optional argument; those after which the engine has failed (a
# mismatch was raised) end the process, so they come last in a `seq`
SCENARIOS = {
    "fit": lambda modes: [fit_mode(m) for m in modes.split(",")],
    "overlap": lambda _: overlap(),
    "syncbn": lambda _: syncbn(),
    "callbacks": callbacks_mode,
    "averaging": lambda _: averaging(),
    "earlystop": lambda _: earlystop(),
}
ENGINE_FAILS = {"nonegrads": none_grads, "bucketcap": bucketcap, "mismatch": mismatch}


def run(name, arg=None):
    if name in ENGINE_FAILS:
        ENGINE_FAILS[name]()
        os._exit(0)  # the engine has failed (the mismatch it raised): skip the collective shutdown
    SCENARIOS[name](arg)


if __name__ == "__main__":
    hvd.init()
    if sys.argv[1] == "seq":  # several scenarios in one job, "name" or "name=arg" each: one TensorFlow start-up
        for spec in sys.argv[2:]:
            name, _, arg = spec.partition("=")
            run(name, arg or None)
    else:
        run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    hvd.shutdown()
