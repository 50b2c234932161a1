"""Worker for tests/multiproc/test_tf_native.py (started by `fastxfer run`): the same programs
through fastxfer's native TensorFlow ops or the tf.numpy_function bridge (FASTXFER_TF_NATIVE),
results saved for a bit-for-bit comparison; buffer forwarding; the timeline."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer.tensorflow as hvd  # noqa: E402
from fastxfer.tensorflow import native  # noqa: E402


def inputs(r):
    rng = np.random.default_rng(10 + r)
    x = (rng.standard_normal((37, 11)) * 3).astype(np.float32)
    return {
        "f32": x,
        "f64": rng.standard_normal(29),
        "f16": x[:5].astype(np.float16),
        "bf16": tf.cast(x[:7], tf.bfloat16).numpy(),
        "i32": rng.integers(-1000, 1000, 41).astype(np.int32),
        "i64": rng.integers(-2**40, 2**40, 13),
    }


def programs(out):
    """Eager and traced collectives of every dtype and wire format, then a Keras 3 fit; every
    result goes to OUT.<rank>.npz."""
    r = hvd.rank()
    ins = inputs(r)
    got = {}
    for k, v in ins.items():
        t = tf.constant(v)
        for op in ("sum", "min", "max") + (("average",) if k not in ("i32", "i64") else ()):
            got[f"eager.{k}.{op}"] = hvd.allreduce(t, op=op, name=f"e.{k}.{op}").numpy()
    for c in ("bf16", "fp16"):
        got[f"eager.f32.{c}"] = hvd.allreduce(tf.constant(ins["f32"]), op="average", compression=c,
                                              prescale_factor=0.5, postscale_factor=3.0).numpy()
    got["eager.bcast"] = hvd.broadcast(tf.constant(ins["f64"]), root_rank=1).numpy()
    got["eager.gather"] = hvd.allgather(tf.constant(ins["i32"][: 5 + 3 * r])).numpy()

    @tf.function
    def graph(a, b, c):
        red = hvd.grouped_allreduce([a, b, c], op="average", names=["g.a", "g.b", "g.c"])
        red += hvd.grouped_allreduce([a, a * 3.0], op="average", compression="bf16", names=["g.d", "g.e"])
        s = hvd.allreduce(a * 2.0, op="sum", compression="fp16", name="g.sum")
        bb = hvd.broadcast(c, root_rank=0, name="g.bcast")
        gg = hvd.allgather(a[: 3 + r], name="g.gather")
        return red + [s, bb, gg]

    for step in range(2):
        for i, v in enumerate(graph(tf.constant(ins["f32"]), tf.constant(ins["f16"]), tf.constant(ins["bf16"]))):
            got[f"graph.{step}.{i}"] = v.numpy()

    import keras

    import fastxfer.keras as khvd

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((11,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression="bf16"),
                  loss="mse")
    rng = np.random.default_rng(r)
    model.fit(rng.standard_normal((64, 11)).astype(np.float32), rng.standard_normal((64, 3)).astype(np.float32),
              batch_size=16, epochs=2, shuffle=False, verbose=0)
    for i, w in enumerate(model.get_weights()):
        got[f"keras.{i}"] = w
    _save(out, r, got, "programs")


def engine_collectives(out):
    """The engine-level collectives through TensorFlow (eager and tf.function): the new dtypes and Product on
    allreduce/broadcast/allgather, alltoall (default, uneven and empty splits; its gradient),
    reducescatter and grouped_reducescatter (uneven rows; gradients; fp16 compression). Results
    go to OUT.<rank>.npz; the test checks exact values and native == bridge bit for bit."""

    r = hvd.rank()
    got = {}
    for dt in (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.bool):
        x = tf.constant(np.arange(200, 213) * (r + 1) % 256 % (2 if dt == tf.bool else 256)).numpy()
        t = tf.cast(tf.constant(x), dt)
        for op in ("sum", "min", "max", "product") + (("average",) if dt != tf.bool else ()):
            got[f"eager.{dt.name}.{op}"] = hvd.allreduce(t, op=op, name=f"e15.{dt.name}.{op}").numpy()
        got[f"eager.{dt.name}.bcast"] = hvd.broadcast(t, root_rank=1).numpy()
        got[f"eager.{dt.name}.gather"] = hvd.allgather(t[: 3 + r]).numpy()
    got["eager.f32.product"] = hvd.allreduce(tf.constant([1.5, -2.0, 3.0]) * (r + 1), op=hvd.Product).numpy()
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(6, 2) + 100 * r)
    got["eager.a2a.even"] = hvd.alltoall(x).numpy()
    o, rs = hvd.alltoall(x[: 2 + r], splits=[2 + r, 0])
    got["eager.a2a.uneven"], got["eager.a2a.uneven.splits"] = o.numpy(), rs.numpy()
    o, rs = hvd.alltoall(tf.zeros((0, 2), tf.int32), splits=[0, 0])
    got["eager.a2a.empty"], got["eager.a2a.empty.splits"] = o.numpy(), rs.numpy()
    got["eager.rs.sum"] = hvd.reducescatter(tf.constant(np.arange(10, dtype=np.float64).reshape(5, 2)) * (r + 1),
                                            op=hvd.Sum).numpy()
    got["eager.rs.avg.i32"] = hvd.reducescatter(tf.constant([[7], [-3], [1]], tf.int32) * (r + 1)).numpy()
    got["eager.rs.fp16"] = hvd.reducescatter(tf.constant([[0.1, 0.2]] * 3) * (r + 1), compression="fp16").numpy()
    g = hvd.grouped_reducescatter([tf.ones((3, 2)) * (r + 1), tf.ones((4,), tf.int64)], op=hvd.Sum)
    got["eager.grs.0"], got["eager.grs.1"] = g[0].numpy(), g[1].numpy()
    with tf.GradientTape() as tape:
        tape.watch(x)
        o, _ = hvd.alltoall(x, splits=[1, 5])
        y = hvd.reducescatter(x * 2.0, op=hvd.Average)
        loss = tf.reduce_sum(o * o) + tf.reduce_sum(y * y)
    got["eager.grad"] = tape.gradient(loss, x).numpy()

    @tf.function
    def graph(a, b):
        with tf.GradientTape() as tape:
            tape.watch(a)
            o, rs = hvd.alltoall(a, splits=[1 + r, 5 - r], name="g.a2a")
            d = hvd.alltoall(a, name="g.a2a.even")
            y = hvd.reducescatter(a * 2.0, op=hvd.Sum, name="g.rs")
            loss = tf.reduce_sum(o * o) + tf.reduce_sum(y) + tf.reduce_sum(d)
        gr = tape.gradient(loss, a)
        p = hvd.allreduce(b, op="product", name="g.prod")
        bo = hvd.allreduce(tf.cast(b, tf.bool), op="sum", name="g.bool")
        gs = hvd.grouped_reducescatter([a, tf.cast(b, tf.float16)], op=hvd.Average)
        return [o, rs, d, y, gr, p, bo] + gs

    for step in range(2):
        for i, v in enumerate(graph(x, tf.constant([r, 2, 3], tf.uint8))):
            got[f"graph.{step}.{i}"] = v.numpy()
    _save(out, r, got, "engine_collectives")


def legacy(out):
    """tf-keras (TF_USE_LEGACY_KERAS=1): DistributedOptimizer with fp16 compression, a few steps."""
    r = hvd.rank()
    import fastxfer.keras as khvd

    keras = tf.keras
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((11,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="fp16"), loss="mse")
    rng = np.random.default_rng(r)
    model.fit(rng.standard_normal((64, 11)).astype(np.float32), rng.standard_normal((64, 3)).astype(np.float32),
              batch_size=16, epochs=2, shuffle=False, verbose=0)
    _save(out, r, {f"tfkeras.{i}": w for i, w in enumerate(model.get_weights())}, "legacy")


def _save(out, r, got, tag):
    np.savez(f"{out}.{r}.npz", **{k: np.asarray(v) for k, v in got.items()})
    print(f"OK {tag} rank {r} native={native.library() is not None} pending={native.pending()}", flush=True)


def forwarding():
    """A gradient's buffer is reduced in place only when nothing else reads it: a tensor that
    another op reads after the reduction still holds its own values; eager inputs are untouched."""
    r, n = hvd.rank(), hvd.size()
    assert native.library() is not None, native.reason()
    x = np.arange(1000, dtype=np.float32) + r
    own = (x * 2.0).astype(np.float32)
    total = sum((np.arange(1000, dtype=np.float32) + k) * 2.0 for k in range(n)).astype(np.float32)

    @tf.function
    def shared(t):
        g = t * 2.0                      # a fresh buffer...
        red = hvd.allreduce(g, op="sum", name="fw.shared")
        with tf.control_dependencies([red]):
            later = tf.identity(g) + 0.0  # ...that another op reads after the reduction
        return red, later

    before = native.buffers()
    red, later = shared(tf.constant(x))
    assert np.array_equal(red.numpy(), total), "wrong sum"
    assert np.array_equal(later.numpy(), own), "a reader of the gradient saw the reduced values"
    mid = native.buffers()
    assert mid["allocated"] == before["allocated"] + 1, (before, mid)  # it could not be forwarded

    @tf.function
    def alone(t):
        return hvd.allreduce(t * 2.0, op="sum", name="fw.alone")  # nobody else holds t * 2

    assert np.array_equal(alone(tf.constant(x)).numpy(), total)
    after = native.buffers()
    assert after["in_place"] == mid["in_place"] + 1, (mid, after)  # reduced in its own buffer

    t = tf.constant(x)
    assert np.array_equal(hvd.allreduce(t, op="sum").numpy(), total / 2.0)
    assert np.array_equal(t.numpy(), x), "an eager input was overwritten"
    print(f"OK forwarding rank {r} {after}", flush=True)


def hold():
    """Grouped submits hold until the last of their bucket: a Keras step of ten gradients is one
    negotiation round on every rank, its results are the same as with a round per tensor
    (FASTXFER_TF_HOLD=0, read when the step is traced), the bucket cap splits a group, and a held
    submit whose group never ends still runs (the engine's hold time)."""
    import keras

    import fastxfer as fx
    import fastxfer.keras as khvd
    from fastxfer.tensorflow import ops

    r = hvd.rank()
    assert native.library() is not None, native.reason()
    x = np.random.default_rng(3 + r).random((8 * 8, 16), dtype=np.float32)
    y = np.random.default_rng(5 + r).random((8 * 8, 16), dtype=np.float32)

    def fit(hold_env):
        os.environ["FASTXFER_TF_HOLD"] = hold_env
        keras.utils.set_random_seed(11)
        model = keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(16) for _ in range(5)])
        model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), loss="mse")
        model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0, shuffle=False)  # traces
        before = fx.engine_stats()["rounds"]
        model.fit(x[8:], y[8:], batch_size=8, epochs=1, verbose=0, shuffle=False)  # 7 steps
        return fx.engine_stats()["rounds"] - before, [v.numpy() for v in model.trainable_variables]

    rounds, held_weights = fit("1")
    assert rounds == 7, f"rank {r}: {rounds} negotiation rounds for 7 steps of 10 gradients held to one bucket"
    _, plain_weights = fit("0")
    os.environ.pop("FASTXFER_TF_HOLD")
    for a, b in zip(held_weights, plain_weights):
        assert a.tobytes() == b.tobytes(), "holding the submits changed the result"

    ts = [tf.constant(np.full(256, k + r, np.float32)) for k in range(6)]  # 1 KiB each
    opts = fx.comm.options.allreduce("sum", bucket_cap_mb=2 / 1024)
    assert ops.held(ts, range(6), opts) == {0, 2, 4}  # buckets of 2 KiB: the second of each pair releases
    assert ops.held(ts, [5, 4, 3, 2, 1, 0], opts) == {5, 3, 1}
    assert ops.held(ts, range(6), fx.comm.options.allreduce("sum", "bf16")) == {0, 1, 2, 3, 4}  # default cap
    big = [tf.zeros(ops.HOLD_BYTES // 4 // 2 + 1)] * 5  # float32: each a little over half the hold limit
    got_held = ops.held(big, range(5), fx.comm.options.allreduce("sum", bucket_cap_mb=4))  # a cap above the limit
    assert got_held == {0, 2}, got_held  # runs end at HOLD_BYTES
    got = hvd.grouped_allreduce(ts, op="sum", bucket_cap_mb=2 / 1024)
    for k, g in enumerate(got):
        assert np.array_equal(g.numpy(), np.full(256, 2 * k + 1, np.float32)), k

    t = tf.constant(np.arange(100, dtype=np.float32) + r)
    from fastxfer.tensorflow import backend

    p = backend.submit(t, fx.comm.options.allreduce("sum"), "hold.orphan", hold=True)  # no submit ever releases it
    got = backend.wait(p).numpy()
    assert np.array_equal(got, 2 * np.arange(100, dtype=np.float32) + 1), got[:4]
    print(f"OK hold rank {r}", flush=True)


def timeline():
    """Keras 3 fit with FASTXFER_TIMELINE set (by the test): every gradient reaches the file."""
    import keras

    import fastxfer.keras as khvd

    r = hvd.rank()
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(3)])
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(np.ones((24, 8), np.float32), np.zeros((24, 8), np.float32), batch_size=8, epochs=1, verbose=0)
    print("OK timeline rank %d vars %s" % (r, json.dumps([v.path for v in model.trainable_variables])), flush=True)
    khvd.shutdown()  # writes the file


if __name__ == "__main__":
    # MODE[,MODE...] [OUT]: several modes share one job (TensorFlow starts once); programs,
    # engine_collectives and legacy save their results to OUT-<mode>.<rank>.npz
    hvd.init()
    saving = {"programs": programs, "engine_collectives": engine_collectives, "legacy": legacy}
    others = {"forwarding": forwarding, "hold": hold, "timeline": timeline}
    for what in sys.argv[1].split(","):
        if what in saving:
            saving[what](f"{sys.argv[2]}-{what}")
        elif what in others:
            others[what]()
        else:
            raise SystemExit(f"unknown test {what!r}")
