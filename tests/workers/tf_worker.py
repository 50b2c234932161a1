"""Worker for tests/test_tensorflow.py (started by `fastxfer run`)."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer.tensorflow as hvd  # noqa: E402


def collectives():
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) + r)
    want_avg = np.arange(6, dtype=np.float32).reshape(2, 3) + (n - 1) / 2
    np.testing.assert_allclose(hvd.allreduce(x).numpy(), want_avg)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum).numpy(), want_avg * n)
    assert hvd.allreduce(tf.constant([r], tf.int64), op=hvd.Max).numpy().tolist() == [n - 1]
    b = hvd.broadcast(tf.constant([10.0 * (r + 1)]), root_rank=n - 1)
    assert b.numpy().tolist() == [10.0 * n]
    g = hvd.allgather(tf.fill([r + 1, 2], float(r)))
    assert g.shape == (n * (n + 1) // 2, 2)

    @tf.function
    def graph(t):
        a = hvd.allreduce(t, op=hvd.Sum, name="g.sum")
        c = hvd.allreduce(tf.cast(t, tf.bfloat16), op=hvd.Average, name="g.bf16")
        bb = hvd.broadcast(t, root_rank=0, name="g.bcast")
        gg = hvd.allgather(t, name="g.gather")
        return a, c, bb, gg

    for step in range(3):  # the same traced graph, run again
        a, c, bb, gg = graph(x)
        np.testing.assert_allclose(a.numpy(), want_avg * n)
        np.testing.assert_allclose(c.numpy().astype(np.float32), want_avg, rtol=1e-2)
        np.testing.assert_allclose(bb.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        assert gg.shape == (2 * n, 3)
    print(f"OK tf collectives rank {r}")


def tape(compression):
    r, n = hvd.rank(), hvd.size()
    tf.keras.utils.set_random_seed(100 + r)  # different initial weights on every rank
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 5)).astype(np.float32)
    Y = (X @ rng.standard_normal((5, 2)) + 0.5).astype(np.float32)
    w = tf.Variable(tf.random.normal((5, 2)))
    b = tf.Variable(tf.zeros((2,)))
    hvd.broadcast_variables([w, b], root_rank=0)
    w0, b0 = w.numpy().copy(), b.numpy().copy()
    opt = tf.keras.optimizers.SGD(0.05)
    shard = slice(r * 64 // n, (r + 1) * 64 // n)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as t:
            loss = tf.reduce_mean((x @ w + b - y) ** 2)
        tape = hvd.DistributedGradientTape(t, compression=compression)
        gw, gb = tape.gradient(loss, [w, b])
        opt.apply_gradients([(gw, w), (gb, b)])
        return loss

    for _ in range(20):
        step(X[shard], Y[shard])
    # every rank holds the same weights, bit for bit
    mine = np.concatenate([w.numpy().ravel(), b.numpy().ravel()])
    everyone = hvd.allgather(tf.constant(mine[None])).numpy()
    assert (everyone == everyone[0]).all(), "weights differ between ranks"
    # and they match one process training on the whole batch (same start), within tolerance
    rw, rb = tf.Variable(w0), tf.Variable(b0)
    ropt = tf.keras.optimizers.SGD(0.05)
    for _ in range(20):
        with tf.GradientTape() as t:
            loss = tf.reduce_mean((X @ rw + rb - Y) ** 2)
        ropt.apply_gradients(zip(t.gradient(loss, [rw, rb]), [rw, rb]))
    ref = np.concatenate([rw.numpy().ravel(), rb.numpy().ravel()])
    # bf16 rounds every gradient to 8 significant bits (relative error <= 2^-9 per rounding, twice
    # per step: input and result), so the weights can drift by < 0.4% of their total update; 1e-2
    # relative bounds that with margin. float32: only summation order differs (1e-5).
    tol = 1e-5 if compression == "none" else 1e-2
    err = np.max(np.abs(mine - ref) / (np.abs(ref) + 1))
    assert err < tol, f"max relative difference {err} (tolerance {tol})"
    print(f"OK tape {compression} rank {r} err {err:.2e}")


if __name__ == "__main__":
    hvd.init()
    for what in sys.argv[1:]:  # "collectives" or "tape=COMPRESSION", several in one job (TensorFlow starts once)
        name, _, arg = what.partition("=")
        collectives() if name == "collectives" else tape(arg)
    hvd.shutdown()
