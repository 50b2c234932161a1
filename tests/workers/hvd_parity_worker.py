"""Worker for tests/multiproc/test_horovod_parity.py (started by `fastxfer run`): Horovod names and
semantics that issue 15 adds -- each mode checks exact values against a reference computed here by
hand (numpy, float64) and that what must be identical on every rank is bit-identical.

Usage: hvd_parity_worker.py MODE[,MODE...] [DIR]; with TF_USE_LEGACY_KERAS=1 the Keras modes run
on tf-keras models."""

import json
import os
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if LEGACY:
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

import fastxfer.keras as hvd  # noqa: E402
import fastxfer.tensorflow as htf  # noqa: E402
from _checks import expect, expect_raises  # noqa: E402

B, D, O = 4, 3, 2  # batch per rank, inputs, outputs


def gathered(vec):
    """Every rank's vector, stacked (rank order)."""
    return htf.allgather(tf.constant(np.asarray(vec, np.float64).ravel()[None])).numpy()


def same_on_all_ranks(vec) -> bool:
    g = gathered(vec)
    return bool((g == g[0]).all())


def flat(variables):
    return np.concatenate([np.asarray(v.numpy() if hasattr(v, "numpy") else v, np.float64).ravel()
                           for v in variables]) if variables else np.zeros(0)


def data(steps, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, n, B, D)).astype(np.float32)
    y = rng.standard_normal((steps, n, B, O)).astype(np.float32)
    return x, y


# -- 1. BroadcastGlobalVariablesCallback ----------------------------------------------------------

def lazybcast():
    """A Sequential without Input is built by its first batch: the callback broadcasts after that
    batch (Horovod's behaviour), so the weights differ after step 1 (each rank started from its
    own initial weights) and are identical from step 2 on and at the end."""
    r, n = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(10 + r)  # different initial weights on every rank
    model = keras.Sequential([keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(O)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    before, after = {}, {}

    class Before(keras.callbacks.Callback):  # runs before the broadcast callback
        def on_train_batch_end(self, batch, logs=None):
            before[batch] = flat(self.model.variables)

    class After(keras.callbacks.Callback):  # after it: what the next step starts from
        def on_train_batch_end(self, batch, logs=None):
            after[batch] = (flat(self.model.variables), flat(self.model.optimizer.variables))

    x, y = data(5, n)
    model.fit(x[:, r].reshape(-1, D), y[:, r].reshape(-1, O), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[Before(), hvd.callbacks.BroadcastGlobalVariablesCallback(0), After()])
    expect(not same_on_all_ranks(before[0]), "before the first broadcast the ranks' weights should differ")
    for b in range(5):
        expect(same_on_all_ranks(after[b][0]), f"model weights differ between ranks after batch {b}")
        expect(same_on_all_ranks(after[b][1]), f"optimizer state differs between ranks after batch {b}")
    expect(np.array_equal(after[0][0], gathered(before[0])[0]), "after batch 0 every rank must hold rank 0's weights")
    expect(same_on_all_ranks(flat(model.variables)), "weights differ at the end")
    print(f"OK lazybcast rank {r}", flush=True)


def localbcast():
    """local_variables: kept out of the broadcast (with their momentum), the rest is rank 0's."""
    r, n = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(20 + r)
    inp = keras.Input((D,))
    first = keras.layers.Dense(5, name="first")
    model = keras.Model(inp, keras.layers.Dense(O, name="second")(first(inp)))
    init = {id(v): v.numpy().copy() for v in model.variables}
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")  # a plain optimizer: no reduction
    seen = {}

    class Start(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                seen.update({id(v): v.numpy().copy() for v in self.model.variables})

    x, y = data(1, n)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[first.kernel])
    model.fit(x[:, r].reshape(-1, D), y[:, r].reshape(-1, O), batch_size=B, epochs=1, verbose=0,
              callbacks=[cb, Start()])
    for v in model.variables:
        mine, root = init[id(v)], gathered(init[id(v)])[0].reshape(init[id(v)].shape)
        if v is first.kernel:
            expect(np.array_equal(seen[id(v)], mine), "a local variable was overwritten by the broadcast")
            expect(not same_on_all_ranks(seen[id(v)]), "local variable should differ between ranks")
        else:
            expect(np.array_equal(seen[id(v)], root.astype(seen[id(v)].dtype)), f"{v.name} is not rank 0's")
    expect_raises(ValueError, lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["w"]),
                  "All local variables must be of tf.Variable type.")
    print(f"OK localbcast rank {r}", flush=True)


# -- 2. local gradients: PartialDistributedOptimizer, register_local_var, PartialDistributedGradientTape

def two_branch_model():
    """out = glob(x) + loc(x), same initial weights on every rank (fixed seed)."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((D,))
    glob = keras.layers.Dense(O, name="glob")
    loc = keras.layers.Dense(O, name="loc")
    model = keras.Model(inp, keras.layers.Add()([glob(inp), loc(inp)]))
    return model, glob, loc


def reference_partial(w0, x, y, lr, scale_local, steps):
    """numpy float64: SGD on mse, glob's gradients averaged over ranks, loc's kept local (divided by
    size when scale_local). w0 = [glob kernel, glob bias, loc kernel, loc bias]. Returns per rank."""
    n = x.shape[1]
    ws = [[np.array(w, np.float64) for w in w0] for _ in range(n)]
    for s in range(steps):
        grads = []
        for r in range(n):
            gk, gb, lk, lb = ws[r]
            xs, ys = x[s, r].astype(np.float64), y[s, r].astype(np.float64)
            d = 2.0 * (xs @ gk + gb + xs @ lk + lb - ys) / ys.size
            grads.append([xs.T @ d, d.sum(0), xs.T @ d, d.sum(0)])
        avg = [sum(g[i] for g in grads) / n for i in range(2)]
        for r in range(n):
            f = 1.0 / n if scale_local else 1.0
            for i, g in enumerate(avg + [grads[r][2] * f, grads[r][3] * f]):
                ws[r][i] = ws[r][i] - lr * g
    return ws


def check_partial(tag, ws, glob, loc, ref):
    r = hvd.rank()
    mine = [np.asarray(v.numpy(), np.float64) for v in (glob.kernel, glob.bias, loc.kernel, loc.bias)]
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(mine, ref[r]))
    expect(err < 2e-6, f"{tag}: differs from the reference computed by hand by {err:.3g}")
    expect(same_on_all_ranks(flat(mine[:2])), f"{tag}: the shared layer differs between ranks")
    expect(not same_on_all_ranks(flat(mine[2:])), f"{tag}: the local layer should differ between ranks")
    return err


def partial(mode):
    """mode: fit | eager (model.fit with run_eagerly) | register (DistributedOptimizer.register_local_var,
    scale_local_gradients=False)."""
    r, n = hvd.rank(), hvd.size()
    steps, lr = 3, 0.1
    model, glob, loc = two_branch_model()
    w0 = [v.numpy().copy() for v in (glob.kernel, glob.bias, loc.kernel, loc.bias)]
    if mode == "register":
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), scale_local_gradients=False)
        opt.register_local_var(loc.kernel)
        opt.register_local_var(loc.bias)
    else:
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=[loc])
    model.compile(optimizer=opt, loss="mse", run_eagerly=(mode == "eager"))
    x, y = data(steps, n, seed=1)
    model.fit(x[:, r].reshape(-1, D), y[:, r].reshape(-1, O), batch_size=B, epochs=1, shuffle=False, verbose=0)
    ref = reference_partial(w0, x, y, lr, mode != "register", steps)
    err = check_partial(f"partial {mode}", None, glob, loc, ref)
    print(f"OK partial {mode} rank {r} err {err:.2e}", flush=True)


def partialtape(mode):
    """PartialDistributedGradientTape (local_layers) and DistributedGradientTape.register_local_source,
    eagerly and inside a tf.function."""
    r, n = hvd.rank(), hvd.size()
    steps, lr = 3, 0.1
    x, y = data(steps, n, seed=2)
    for how in ("partial", "register"):
        model, glob, loc = two_branch_model()
        w0 = [v.numpy().copy() for v in (glob.kernel, glob.bias, loc.kernel, loc.bias)]
        opt = keras.optimizers.SGD(lr)

        def step(xb, yb):
            with tf.GradientTape() as t:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            if how == "partial":
                tape = htf.PartialDistributedGradientTape(t, local_layers=loc)
            else:
                tape = htf.DistributedGradientTape(t)
                tape.register_local_source(loc.kernel)
                tape.register_local_source(loc.bias)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        fn = tf.function(step) if mode == "function" else step
        for s in range(steps):
            fn(tf.constant(x[s, r]), tf.constant(y[s, r]))
        ref = reference_partial(w0, x, y, lr, True, steps)
        err = check_partial(f"partialtape {mode} {how}", None, glob, loc, ref)
    expect_raises(ValueError, lambda: htf.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[1]),
                  "All local layers must be of tf.keras.layers.Layer type.")
    print(f"OK partialtape {mode} rank {r} err {err:.2e}", flush=True)


# -- 3. learning-rate callbacks, BestModelCheckpoint ----------------------------------------------

def lrcallbacks(directory):
    r, n = hvd.rank(), hvd.size()
    steps = 3
    x, y = data(steps, n, seed=3)
    xs, ys = x[:, r].reshape(-1, D), y[:, r].reshape(-1, O)

    def model_and_recorder(lr):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(O)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)), loss="mse")
        rec = {"lr": [], "ratio": []}

        class Record(keras.callbacks.Callback):  # after the schedule callback
            def on_train_batch_begin(self, batch, logs=None):
                opt = self.model.optimizer
                lr_now = float(np.asarray(opt.learning_rate))
                moms = [m.numpy().copy() for m in opt.momentums] if getattr(opt, "built", True) and \
                    getattr(opt, "momentums", None) else None
                if rec.get("end") is not None and moms is not None:
                    prev_lr, prev = rec["end"]
                    # momentum correction: the buffers were scaled by lr_new / lr_old before this batch
                    want = [p * np.float32(lr_now / prev_lr) for p in prev]
                    rec["ratio"].append(max(float(np.max(np.abs(a - b))) for a, b in zip(moms, want)))
                rec["lr"].append(lr_now)

            def on_train_batch_end(self, batch, logs=None):
                opt = self.model.optimizer
                rec["end"] = (float(np.asarray(opt.learning_rate)), [m.numpy().copy() for m in opt.momentums])

        return model, rec, Record()

    # staircase, constant multiplier (exponential decay) between epochs 1 and 3 (exclusive)
    model, rec, record = model_and_recorder(0.1)
    sched = hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=3, staircase=True)
    hist = model.fit(xs, ys, batch_size=B, epochs=4, shuffle=False, verbose=0, callbacks=[sched, record])
    want = [0.1] * steps + [0.1] * steps + [0.05] * steps + [0.05] * steps
    np.testing.assert_allclose(rec["lr"], want, rtol=1e-6)
    np.testing.assert_allclose(hist.history["lr"], [0.1, 0.1, 0.05, 0.05], rtol=1e-6)
    expect(max(rec["ratio"]) < 1e-7, f"momentum correction: {max(rec['ratio'])}")
    # smooth, callable multiplier, steps_per_epoch read from Keras
    model, rec, record = model_and_recorder(0.1)
    sched = hvd.callbacks.LearningRateScheduleCallback(0.3, lambda e: 1.0 / (1.0 + e), staircase=False,
                                                       momentum_correction=False)
    model.fit(xs, ys, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[sched, record])
    want = [0.3 / (1.0 + e + b / steps) for e in range(2) for b in range(steps)]
    np.testing.assert_allclose(rec["lr"], want, rtol=1e-6)
    # Horovod's warm-up: lr = initial/size * ((e + 1/steps) * (size-1)/warmup + 1), then left alone
    model, rec, record = model_and_recorder(0.1)
    warm = hvd.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2)
    model.fit(xs, ys, batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[warm, record])
    want = [0.4 / n * ((e + b / steps + 1.0 / steps) * (n - 1) / 2 + 1) for e in range(2) for b in range(steps)]
    want += [want[-1]] * steps
    np.testing.assert_allclose(rec["lr"], want, rtol=1e-6)
    expect(abs(want[-1] - 0.4) < 1e-12, "the warm-up ends at initial_lr")
    expect(max(rec["ratio"]) < 1e-7, f"warm-up momentum correction: {max(rec['ratio'])}")
    expect(same_on_all_ranks(flat(model.variables)), "weights differ between ranks")
    expect_raises(ValueError, lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5),
                  "Parameter `initial_lr` is required")

    # BestModelCheckpoint: rank 0 writes, only when the (averaged) monitored value improves
    class Score(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["score"] = [3.0, 1.0, 2.0, 0.5][epoch] + r  # averaged: +(n-1)/2 everywhere

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(O)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    best = hvd.callbacks.BestModelCheckpoint(monitor="score", mode="min")
    best.filepath = os.path.join(directory, f"best-{r}-{{epoch}}.h5")
    model.fit(xs, ys, batch_size=B, epochs=4, shuffle=False, verbose=0,
              callbacks=[Score(), hvd.callbacks.MetricAverageCallback(), best])
    htf.allreduce(tf.constant(0.0), name="files-written")
    files = sorted(f for f in os.listdir(directory) if f.startswith("best-"))
    expect(files == ["best-0-1.h5", "best-0-2.h5", "best-0-4.h5"], files)
    expect_raises(ValueError, lambda: model.fit(xs, ys, batch_size=B, verbose=0,
                                                callbacks=[hvd.callbacks.BestModelCheckpoint()]), ".filepath")
    print(f"OK lrcallbacks rank {r}", flush=True)


# -- 4. queries -------------------------------------------------------------------------------------

def queries():
    import importlib.util

    r, n = hvd.rank(), hvd.size()
    eager = [int(f().numpy()) for f in (htf.size_op, htf.rank_op, htf.local_size_op, htf.local_rank_op)]
    traced = tf.function(lambda: [htf.size_op(), htf.rank_op(), htf.local_size_op(), htf.local_rank_op()])()
    expect(eager == [n, r, n, r] and [int(t.numpy()) for t in traced] == eager, (eager, traced))
    expect(all(t.dtype == tf.int32 for t in traced), "size_op & co. are int32 tensors")
    expect(htf.process_set_included_op().numpy() == 1, "process_set_included_op")
    for m in (htf, hvd):
        expect((m.cross_rank(), m.cross_size(), m.is_homogeneous()) == (0, 1, True), "one host")
        expect(m.mpi_built() == (importlib.util.find_spec("mpi4py") is not None), "mpi_built")
        expect(m.mpi_enabled() is False, "mpi_enabled: fastxfer run starts no MPI")
        expect_raises(ValueError, m.mpi_threads_supported, "MPI is not enabled")
        for f in (m.gloo_built, m.gloo_enabled, m.ddl_built, m.ccl_built, m.cuda_built, m.rocm_built, m.sycl_built):
            expect(f() is False, f.__name__)
        expect(m.nccl_built() == 0, "nccl_built")
        # the job's timeline at run time: one file from rank 0 with every rank's row (the path is
        # rank 0's; the launcher's pid in it keeps concurrent test jobs apart)
        path = os.path.join(tempfile.gettempdir(), f"fastxfer-hvd-timeline-{os.getppid()}-{m.__name__}.json")
        m.start_timeline(path, mark_cycles=True)
        expect_raises(ValueError, lambda: m.start_timeline(path), "already being recorded")
        m.allreduce(tf.ones([4]), name=f"timeline.{m.__name__}")
        m.stop_timeline()
        m.stop_timeline()  # a second stop does nothing
        if r == 0:
            with open(path) as f:
                events = json.load(f)
            os.unlink(path)
            expect({e["pid"] for e in events} == set(range(n)), "a row per rank in the one file")
            expect(any(e.get("name") == "CYCLE_START" for e in events), "mark_cycles marks the rounds")
            expect(sum(e.get("name") == "allreduce" for e in events) == n, "the allreduce on every rank's row")
        expect(m.global_process_set.size() == n and m.global_process_set.ranks == list(range(n)), "global set")
        expect_raises(ValueError, lambda: m.add_process_set([0, n]), f"not ranks of this job (0..{n - 1})")
    print(f"OK queries rank {r}", flush=True)


def hostqueries(per_host):
    """Under mpirun, ranks on emulated hosts of per_host ranks each (FASTXFER_HOST_ID = rank // per_host)."""
    r, n = hvd.rank(), hvd.size()
    expect((hvd.cross_size(), hvd.cross_rank()) == (n // per_host, r // per_host),
           (hvd.cross_size(), hvd.cross_rank()))
    expect((hvd.local_size(), hvd.local_rank()) == (per_host, r % per_host), "local rank")
    expect(hvd.mpi_enabled() is True and hvd.mpi_threads_supported() is True, "MPI in use, MPI_THREAD_MULTIPLE")
    expect(int(htf.local_size_op().numpy()) == per_host and hvd.is_homogeneous(), "local_size_op")
    print(f"OK hostqueries rank {r}", flush=True)


# -- 5. signatures ----------------------------------------------------------------------------------

class TimesFour(htf.Compressor):
    """A user compressor (Horovod's interface, a class with static methods): compress multiplies by
    4 (exact), decompress divides; counts its calls."""
    calls = 0

    @staticmethod
    def compress(tensor):
        TimesFour.calls += 1
        return tensor * 4.0, "ctx"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "ctx"
        return tensor / 4.0


def _adasum_parallel(cs):
    """Horovod's Adasum of the vectors c * v (one c per rank, v fixed), as the multiple of v: for
    parallel a = p v, b = q v the pair rule gives (1 - q / 2p) p + (1 - p / 2q) q."""
    cs = list(cs)
    p = 1
    while p * 2 <= len(cs):
        p *= 2
    for k in range(p, len(cs)):
        cs[k - p] = _pair(cs[k - p], cs[k])
    level = 1
    while level < p:
        for k in range(0, p, 2 * level):
            cs[k] = _pair(cs[k], cs[k + level])
        level *= 2
    return cs[0]


def _pair(a, b):
    return (1 - a * b / (2 * a * a)) * a + (1 - a * b / (2 * b * b)) * b


def signatures():
    r, n = hvd.rank(), hvd.size()
    # objects
    obj = {"rank": r, "list": list(range(r + 3))}
    expect(htf.broadcast_object(obj, root_rank=n - 1, name="obj") == {"rank": n - 1, "list": list(range(n + 2))},
           "broadcast_object")
    expect(hvd.broadcast_object(obj if r == 0 else None) == {"rank": 0, "list": [0, 1, 2]}, "broadcast_object (None)")
    expect(htf.broadcast_object_fn(root_rank=0)(r) == 0, "broadcast_object_fn")
    expect(htf.allgather_object(("x" * (r * 100), r)) == [("x" * (k * 100), k) for k in range(n)], "allgather_object")
    expect_raises(RuntimeError, lambda: htf.broadcast_global_variables(0),
                  "hvd.broadcast_global_variables() does not support eager execution. Please use "
                  "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    expect_raises(RuntimeError, lambda: hvd.broadcast_global_variables(0), "does not support eager execution")
    # allreduce / grouped_allreduce: average= (deprecated), op=, prescale/postscale, eagerly and traced
    x = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
    tot = sum(k + 1 for k in range(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)

        def calls(t):
            return [htf.allreduce(t, average=True), htf.allreduce(t, average=False), htf.allreduce(t),
                    htf.allreduce(t, op=htf.Max),
                    htf.allreduce(t, op=htf.Sum, prescale_factor=2.0, postscale_factor=0.5),
                    *htf.grouped_allreduce([t, 2.0 * t], average=False),
                    *htf.grouped_allreduce([t, tf.cast(t, tf.float64)], op=htf.Average,
                                           compression=htf.Compression.bf16, prescale_factor=0.5, postscale_factor=4.0),
                    hvd.allreduce(t, "k.avg", None), hvd.allreduce(t, average=False)]

        base = np.array([1.0, 2.0, 3.0])
        want = [base * tot / n, base * tot, base * tot / n, base * n, base * tot, base * tot, 2 * base * tot,
                base * tot / n * 2.0, base * tot / n * 2.0, base * tot / n, base * tot]
        for how, got in (("eager", calls(x)), ("function", tf.function(calls)(x))):
            for i, (g, w) in enumerate(zip(got, want)):
                expect(np.array_equal(np.asarray(g.numpy(), np.float64), w), f"{how} call {i}: {g.numpy()} != {w}")
    expect_raises(ValueError, lambda: htf.allreduce(x, average=True, op=htf.Sum),
                  "The op parameter supersedes average. Please provide only one of them.")
    expect_raises(ValueError, lambda: htf.grouped_allreduce([x], average=False, op=htf.Sum), "supersedes average")
    expect(htf.grouped_allreduce([]) == [], "grouped_allreduce of nothing")
    # Adasum of parallel gradients c_j * v: the pair rule keeps the longer one's excess over the
    # projection, here a fold over the ranks in tree order (tests/workers/hvd_dtypes_worker.py: any vectors)
    want = _adasum_parallel([float(j + 1) for j in range(htf.size())]) * np.array([1.0, 2.0, 3.0])
    got = htf.allreduce(x, op=htf.Adasum).numpy()
    expect(np.allclose(got, want, rtol=1e-6, atol=0), f"Adasum of parallel vectors: {got} != {want}")
    expect_raises(TypeError, lambda: htf.allreduce(x, process_set=object()), "process_set must be a ProcessSet")
    expect_raises(ValueError, lambda: htf.allreduce(x, process_set=htf.ProcessSet([0])), "is not registered")
    # Compression: built-ins are objects with Horovod's methods and still the wire-format names
    c, ctx = htf.Compression.fp16.compress(tf.constant([1.0, 2.0]))
    expect(c.dtype == tf.float16 and htf.Compression.fp16.decompress(c, ctx).dtype == tf.float32, "fp16 compressor")
    c, ctx = htf.Compression.none.compress(tf.constant([1.0]))
    expect(c.dtype == tf.float32 and htf.Compression.bf16 == "bf16" and hvd.Compression is htf.Compression, "names")
    expect(np.array_equal(htf.allreduce(x, compression="fp16").numpy(), base * tot / n), "string names still work")
    # a user compressor runs around an uncompressed reduction, also in DistributedGradientTape/Optimizer
    before = TimesFour.calls
    expect(np.array_equal(htf.allreduce(x, compression=TimesFour).numpy(), base * tot / n), "user compressor")
    expect(TimesFour.calls == before + 1, "the user compressor was not called")
    w = tf.Variable([1.0, -1.0])
    with tf.GradientTape() as t:
        loss = tf.reduce_sum(w * float(r + 1))
    g = htf.DistributedGradientTape(t, compression=TimesFour).gradient(loss, [w])[0]
    expect(np.array_equal(g.numpy(), np.full(2, tot / n, np.float32)) and TimesFour.calls == before + 2, "tape")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=TimesFour), loss="mse")
    model.fit(np.ones((1, 1), np.float32), np.full((1, 1), float(r + 1), np.float32), batch_size=1, verbose=0)
    # d/dw (w - (r+1))^2 at w=0 is -2(r+1): averaged -2*tot/n, SGD(1.0) gives w = 2*tot/n
    expect(np.array_equal(model.get_weights()[0], np.full((1, 1), 2.0 * tot / n, np.float32)), "optimizer")
    expect(TimesFour.calls > before + 2, "the optimizer did not use the user compressor")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=object()),
                  "compression")
    # Keras 3: experimental_run_tf_function is accepted (and dropped), other unknown keywords are not
    if not LEGACY:
        m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=False)
            m.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=True)
        said = [w for w in caught if "experimental_run_tf_function" in str(w.message)]
        expect(len(said) == (1 if r == 0 else 0), f"warned {len(said)} times on rank {r}")
        expect_raises(TypeError, lambda: m.compile(optimizer="sgd", loss="mse", no_such_keyword=1), "no_such_keyword")
    print(f"OK signatures rank {r}", flush=True)


# -- 6. sparse gradients -------------------------------------------------------------------------------

V, E, T = 7, 3, 4  # vocabulary, embedding width, tokens per sample


def embedding_data(steps, n):
    rng = np.random.default_rng(4)
    idx = rng.integers(0, V, size=(steps, n, B, T)).astype(np.int32)
    idx[:, :, 0, :2] = 1  # a row every rank touches, twice per sample: duplicate indices
    y = rng.standard_normal((steps, n, B, 1)).astype(np.float32)
    return idx, y


def embedding_model():
    keras.utils.set_random_seed(8)
    inp = keras.Input((T,), dtype="int32")
    emb = keras.layers.Embedding(V, E, name="emb")
    h = keras.layers.GlobalAveragePooling1D()(emb(inp))
    out = keras.layers.Dense(1, use_bias=False, name="head")(h)
    return keras.Model(inp, out), emb


def reference_embedding(table, w, idx, y, lr, steps):
    """numpy float64: SGD on mse of mean-pooled embeddings times w, gradients averaged over ranks."""
    table, w = table.astype(np.float64), w.astype(np.float64)
    n = idx.shape[1]
    for s in range(steps):
        gt, gw = np.zeros_like(table), np.zeros_like(w)
        for r in range(n):
            h = table[idx[s, r]].mean(axis=1)  # (B, E)
            d = 2.0 * (h @ w - y[s, r]) / y[s, r].size  # (B, 1)
            gw += h.T @ d / n
            dh = d @ w.T / T  # (B, E), per token
            for b in range(B):
                for t in range(T):
                    gt[idx[s, r, b, t]] += dh[b] / n
        table, w = table - lr * gt, w - lr * gw
    return table, w


def sparse(mode):
    """mode: tape-eager | tape-function | fit (DistributedOptimizer), each with sparse_as_dense False
    (allgather) and True (densified)."""
    r, n = hvd.rank(), hvd.size()
    steps, lr = 3, 0.5
    idx, y = embedding_data(steps, n)
    for dense in (False, True):
        model, emb = embedding_model()
        table0, w0 = [v.numpy().copy() for v in model.trainable_variables]
        kinds = []
        if mode == "fit":
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), sparse_as_dense=dense)
            model.compile(optimizer=opt, loss="mse")
            before = htf.submitted
            model.fit(idx[:, r].reshape(-1, T), y[:, r].reshape(-1, 1), batch_size=B, shuffle=False, verbose=0)
            # per step: the head's allreduce and the table's allreduce, or its two allgathers
            per_step = (htf.submitted - before) / steps
            expect(per_step == (2 if dense else 3), f"{per_step} collectives per step")
        else:
            opt = keras.optimizers.SGD(lr)

            def train(xb, yb):
                with tf.GradientTape() as t:
                    loss = tf.reduce_mean(tf.square(model(xb) - yb))
                grads = htf.DistributedGradientTape(t, sparse_as_dense=dense).gradient(loss, model.trainable_variables)
                kinds.append(type(grads[0]).__name__)
                if not dense:  # every rank's rows, gathered
                    expect(grads[0].values.shape[0] in (None, n * B * T), grads[0].values.shape)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            fn = tf.function(train) if mode == "tape-function" else train
            for s in range(steps):
                fn(tf.constant(idx[s, r]), tf.constant(y[s, r]))
            expect(kinds and all((k != "IndexedSlices") == dense for k in kinds), f"gradient kinds {kinds}")
        table, w = reference_embedding(table0, w0, idx, y, lr, steps)
        got_t, got_w = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
        err = max(float(np.max(np.abs(got_t - table))), float(np.max(np.abs(got_w - w))))
        expect(err < 2e-6, f"sparse {mode} dense={dense}: differs from the reference by {err:.3g}")
        expect(same_on_all_ranks(flat(model.trainable_variables)), f"sparse {mode} dense={dense}: ranks differ")
        print(f"OK sparse {mode} sparse_as_dense={dense} rank {r} err {err:.2e}", flush=True)


if __name__ == "__main__":
    hvd.init()
    for what in sys.argv[1].split(","):
        if what == "lazybcast":
            lazybcast()
        elif what == "localbcast":
            localbcast()
        elif what.startswith("partialtape-"):
            partialtape(what.split("-", 1)[1])
        elif what.startswith("partial-"):
            partial(what.split("-", 1)[1])
        elif what == "lrcallbacks":
            lrcallbacks(sys.argv[2])
        elif what == "queries":
            queries()
        elif what.startswith("hostqueries-"):
            hostqueries(int(what.split("-", 1)[1]))
        elif what == "signatures":
            signatures()
        elif what.startswith("sparse-"):
            sparse(what.split("-", 1)[1])
        else:
            raise SystemExit(f"unknown mode {what}")
    hvd.shutdown()
