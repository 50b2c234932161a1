"""Worker for tests/multiproc/test_process_sets.py (started by `fastxfer run -np 3`): process sets
on the numpy API and on the Horovod TensorFlow/Keras API, each result checked against values
computed here by hand. Sets: even = [0, 2], odd = [1], pair = [1, 2] (rank 2 is in two sets).

Usage: process_sets_worker.py MODE. Prints 'OK <MODE> rank R' when every check passed."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import fastxfer as fx  # noqa: E402
from fastxfer.comm import group  # noqa: E402
from _checks import expect, expect_raises  # noqa: E402

MODE = sys.argv[1]


def raised(fn) -> BaseException:
    """The exception `fn()` raises (an AssertionError when it raises none)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller checks which kind it is
        return e
    raise AssertionError(f"{fn} raised nothing")


def numpy_sets():
    fx.init()
    r, n = fx.rank(), fx.size()
    expect(n == 3, "run with -np 3")
    even = fx.add_process_set([2, 0])
    odd = fx.add_process_set(fx.ProcessSet([1]))
    pair = fx.add_process_set([1, 2])
    expect([p.process_set_id for p in (even, odd, pair)] == [1, 2, 3], (even, odd, pair))
    # Horovod's repr and str, the global set with its real ranks
    expect(even.ranks == [0, 2] and even.size() == 2 and repr(even) == str(even) ==
           "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)", repr(even))
    expect(str(fx.global_process_set) == "ProcessSet(process_set_id=0, ranks=[0, 1, 2], mpi_comm=None)",
           str(fx.global_process_set))
    # the queries answer on every rank, members or not
    expect([(p.included(), p.rank(), p.size()) for p in (even, odd, pair)] ==
           {0: [(True, 0, 2), (False, None, 1), (False, None, 2)],
            1: [(False, None, 2), (True, 0, 1), (True, 0, 2)],
            2: [(True, 1, 2), (False, None, 1), (True, 1, 2)]}[r], "included()/rank()/size()")
    mine = odd if r == 1 else even

    # allreduce: sum, average (divides by the set's size), in and out of place
    x = np.arange(5, dtype=np.float32) + 100 * r
    want = sum(np.arange(5, dtype=np.float32) + 100 * k for k in mine.ranks)
    expect(np.array_equal(fx.allreduce(x, op="sum", process_set=mine), want), "sum")
    expect(np.array_equal(fx.allreduce(x, op="average", process_set=mine), want / mine.size()), "average")
    i = np.full(3, 7 * (r + 1), np.int32)
    expect(np.array_equal(fx.allreduce(i, op="average", process_set=mine), np.full(3, int(sum(7 * (k + 1) for k in
                                                                                          mine.ranks) / mine.size()))),
           "integer average")
    # allgather in the set's rank order, rank-dependent first dimension
    g = fx.allgather(np.full((r + 1, 2), r, np.int64), process_set=mine)
    expect(np.array_equal(g, np.concatenate([np.full((k + 1, 2), k, np.int64) for k in mine.ranks])), g)
    # broadcast from a root given as a rank of the job (the set's last rank)
    root = mine.ranks[-1]
    b = fx.broadcast(np.full(4, float(r), np.float64), root=root, process_set=mine)
    expect(np.array_equal(b, np.full(4, float(root))), b)
    # alltoall: splits have one entry per rank of the set
    k = mine.size()
    me = mine.rank()
    rows = np.concatenate([np.full((j + 1, 2), 10 * r + j, np.float32) for j in range(k)])
    got, rsplits = fx.alltoall(rows, splits=[j + 1 for j in range(k)], process_set=mine)
    want = np.concatenate([np.full((me + 1, 2), 10 * src + me, np.float32) for src in mine.ranks])
    expect(np.array_equal(got, want) and rsplits.tolist() == [me + 1] * k, (got, rsplits))
    # reducescatter: 5 rows split 3/2 (even) or 5 (odd)
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    part = fx.reducescatter(full * (r + 1), op="sum", process_set=mine)
    counts = [5 // k + (1 if j < 5 % k else 0) for j in range(k)]
    lo = sum(counts[:me])
    expect(np.array_equal(part, full[lo:lo + counts[me]] * sum(q + 1 for q in mine.ranks)), part)
    # the out-of-band lane, barrier, objects
    expect(np.array_equal(fx.oob_allreduce(np.array([r], np.float64), op="sum", process_set=mine),
                          [float(sum(mine.ranks))]), "oob_allreduce")
    fx.barrier(process_set=mine)
    expect(fx.allgather_object({"r": r}, process_set=mine) == [{"r": q} for q in mine.ranks], "allgather_object")
    expect(fx.broadcast_object(("from", r), root=root, process_set=mine) == ("from", root), "broadcast_object")

    # sets run concurrently: rank 2 starts on both of its sets before it waits for either, and in
    # the opposite order from its peers' arrival; the global set runs in between
    v = np.ones(1000, np.float32) * (r + 1)
    handles = []
    if r in pair.ranks:
        handles.append(("pair", fx.allreduce_async(v, op="sum", process_set=pair)))
    if r in even.ranks:
        handles.append(("even", fx.allreduce_async(v, op="sum", process_set=even)))
    world = fx.allreduce(v, op="sum")
    expect(np.array_equal(world, np.full(1000, 6.0, np.float32)), "global set meanwhile")
    for name, h in handles:
        s = {"pair": 2 + 3, "even": 1 + 3}[name]
        expect(np.array_equal(h.wait(), np.full(1000, float(s), np.float32)), name)
    del handles, h  # a Handle keeps its engine (and so the set's mapping) alive

    # errors that name the problem
    # a set this rank is not in: NotInProcessSetError (a FastxferError) from every collective kind,
    # and the next collective works
    outside = odd if r != 1 else even
    for kind, call in (("allreduce", lambda: fx.allreduce(x, process_set=outside)),
                       ("allreduce_async", lambda: fx.allreduce_async(x, process_set=outside)),
                       ("allgather", lambda: fx.allgather(x, process_set=outside)),
                       ("broadcast", lambda: fx.broadcast(x, root=outside.ranks[0], process_set=outside)),
                       ("alltoall", lambda: fx.alltoall(x, process_set=outside)),
                       ("reducescatter", lambda: fx.reducescatter(x, process_set=outside)),
                       ("barrier", lambda: fx.barrier(process_set=outside))):
        e = raised(call)
        expect(isinstance(e, fx.NotInProcessSetError) and isinstance(e, fx.FastxferError)
               and f"rank {r} is not in {outside!r}: only its ranks may run its collectives" in str(e), (kind, e))
    expect(np.array_equal(fx.allreduce(np.ones(2), op="sum"), [3.0, 3.0]), "the next collective after the errors")
    expect_raises(ValueError, lambda: fx.broadcast(x, root=1 if r != 1 else 0, process_set=mine),
                  "is not in the process set")
    expect_raises(ValueError, lambda: fx.allreduce(x, process_set=fx.ProcessSet([0])), "is not registered")
    expect_raises(TypeError, lambda: fx.allreduce(x, process_set=[0, 2]), "process_set must be a ProcessSet")
    expect_raises(ValueError, lambda: fx.ProcessSet([0, 0]), "distinct")
    expect_raises(ValueError, lambda: fx.add_process_set([0, 5]), "not ranks of this job (0..2)")
    expect_raises(ValueError, lambda: fx.add_process_set([0, 2]), "already registered")
    expect_raises(ValueError, lambda: fx.remove_process_set(fx.global_process_set), "cannot be removed")

    # remove: the set's shared memory is unmapped; its ranks' collectives then fail clearly; ids
    # are not reused
    import glob

    seg = f"{group.layout().segment}-s{even.process_set_id}-"  # then 32 random hex digits

    def mapped():
        with open("/proc/self/maps") as f:
            return seg in f.read()

    expect(mapped() == (r != 1), f"{seg}* mapped by the set's ranks only")
    expect(fx.remove_process_set(even) is True, "removed")
    fx.barrier()
    expect(not mapped() and not glob.glob(seg + "*"), f"{seg}* left behind")
    # removed: every collective on it names the id it had, on every rank; removing twice is refused
    expect(repr(even) == "ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)", repr(even))
    removed = "process set 1 (ranks [0, 2]) was removed by remove_process_set"
    expect_raises(fx.ProcessSetRemovedError, lambda: fx.allreduce(x, process_set=even), removed)
    expect_raises(ValueError, lambda: fx.allgather(x, process_set=even), removed)
    expect_raises(fx.ProcessSetRemovedError, lambda: fx.remove_process_set(even), "process set 1 (ranks [0, 2]) was "
                  "removed already")
    expect(fx.remove_process_set(fx.ProcessSet([0, 1])) is False, "removing a set never registered")
    again = fx.add_process_set([0, 2])
    expect(again.process_set_id == 4, again)
    if r != 1:
        expect(np.array_equal(fx.allreduce(x, op="sum", process_set=again), x * 0 + sum(
            np.arange(5, dtype=np.float32) + 100 * q for q in (0, 2))), "re-added set")
    fx.shutdown()
    expect(repr(fx.global_process_set) == "ProcessSet(process_set_id=0, ranks=[], mpi_comm=None)",
           repr(fx.global_process_set))
    # a new job numbers from 1 again; init(process_sets=...) registers them (Horovod's static form)
    static = [fx.ProcessSet([0, 1]), fx.ProcessSet([2])]
    fx.init(process_sets=static)
    expect([p.process_set_id for p in static] == [1, 2], static)
    mine = static[0] if r < 2 else static[1]
    expect(fx.allreduce(np.array([r + 1.0]), op="sum", process_set=mine)[0] == (3.0 if r < 2 else 3.0), "static")
    fx.shutdown()
    print(f"OK numpy rank {r}", flush=True)


def mismatch():
    fx.init()
    r = fx.rank()
    # ranks that pass different sets: a MismatchError on every rank, naming what each passed
    expect_raises(fx.MismatchError, lambda: fx.add_process_set([0, 1] if r == 0 else [0, 2]),
                  "add_process_set: the ranks disagree (rank 0: id 1, ranks [0, 1]; rank 1: id 1, ranks [0, 2]; "
                  "rank 2: id 1, ranks [0, 2])")
    even = fx.add_process_set([0, 2])  # the failed call registered nothing: the next one is id 1
    expect(even.process_set_id == 1, even)
    # a disagreement inside a set fails that set's ranks; the global set goes on
    if r != 1:
        expect_raises(fx.MismatchError, lambda: fx.allreduce(np.ones(3 + r, np.float32), name="g", process_set=even),
                      "but rank 2 submitted allreduce")
    expect(np.array_equal(fx.allreduce(np.ones(2), op="sum"), [3.0, 3.0]), "global set after a set failed")
    print(f"OK mismatch rank {r}", flush=True)


def tensorflow_sets():
    import tensorflow as tf

    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    if legacy:
        import tf_keras as keras
    else:
        import keras
    import fastxfer.keras as hvd
    import fastxfer.tensorflow as htf

    even, odd = htf.ProcessSet([0, 2]), htf.ProcessSet([1])
    hvd.init(process_sets=[even, odd])
    r = hvd.rank()
    mine = odd if r == 1 else even
    pid = mine.process_set_id
    expect(int(htf.size_op(pid).numpy()) == mine.size(), "size_op")
    expect([int(htf.process_set_included_op(p).numpy()) for p in (0, 1, 2)] == [1, int(r != 1), int(r == 1)],
           "process_set_included_op")
    expect_raises(ValueError, lambda: htf.size_op(9), "no process set with id 9")

    x = tf.constant(np.arange(4, dtype=np.float32) + 10 * r)
    want = sum(np.arange(4, dtype=np.float32) + 10 * k for k in mine.ranks)
    root = mine.ranks[-1]

    def calls(t):
        return [htf.allreduce(t, op=htf.Sum, process_set=mine), htf.allreduce(t, process_set=mine),
                htf.grouped_allreduce([t, 2 * t], op=htf.Sum, process_set=mine)[1],
                htf.allgather(t[: r + 1], process_set=mine), htf.broadcast(t, root_rank=root, process_set=mine),
                htf.reducescatter(tf.reshape(t, (2, 2)), op=htf.Sum, process_set=mine)]

    gathered = np.concatenate([(np.arange(4, dtype=np.float32) + 10 * k)[: k + 1] for k in mine.ranks])
    k, me = mine.size(), mine.rank()
    rs = want.reshape(2, 2)[[me] if k == 2 else [0, 1]]
    expected = [want, want / k, 2 * want, gathered, np.arange(4, dtype=np.float32) + 10 * root, rs]
    for how, got in (("eager", calls(x)), ("function", tf.function(calls)(x))):
        for j, (g, w) in enumerate(zip(got, expected)):
            expect(np.array_equal(g.numpy(), w), f"{how} call {j}: {g.numpy()} != {w}")
    expect(htf.allgather_object(r, process_set=mine) == mine.ranks, "allgather_object")
    expect(htf.broadcast_object(r, root_rank=root, process_set=mine) == root, "broadcast_object")

    # DistributedGradientTape in a set: one SGD step of a linear model on this rank's batch, the
    # gradient averaged over the set's ranks only
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 4, 3)).astype(np.float32)  # one batch per rank
    ys = rng.standard_normal((3, 4, 1)).astype(np.float32)
    w = tf.Variable(np.ones((3, 1), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.matmul(xs[r], w) - ys[r]) ** 2)
    grad = htf.DistributedGradientTape(tape, process_set=mine).gradient(loss, [w])[0]
    ref = np.mean([2 * xs[q].T.astype(np.float64) @ (xs[q] @ np.ones((3, 1)) - ys[q]) / 4 for q in mine.ranks], axis=0)
    expect(np.allclose(grad.numpy(), ref, rtol=1e-5, atol=1e-6), (grad.numpy(), ref))

    # Keras: DistributedOptimizer(process_set=...) keeps each set's ranks identical; the two sets
    # train on different data, so they differ
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=mine)
    model.compile(optimizer=opt, loss="mse")
    data_x = xs[r] if r != 1 else xs[1] * 3
    model.fit(data_x, ys[r], batch_size=4, epochs=3, verbose=0, shuffle=False)
    flatw = np.concatenate([v.numpy().ravel() for v in model.weights]).astype(np.float64)
    every = htf.allgather_object(flatw)
    expect(np.array_equal(every[0], every[2]), "the even set's ranks hold identical weights")
    expect(not np.array_equal(every[0], every[1]), "the two sets trained apart")
    outside_the_set(tf, keras, hvd, htf, even, odd)
    hvd.shutdown()
    print(f"OK tensorflow rank {r}", flush=True)


def outside_the_set(tf, keras, hvd, htf, even, odd):
    """Horovod's rules for a rank outside a set (even = [0, 2], odd = [1], on 3 ranks): the tape and
    DistributedOptimizer leave its gradients alone (exact values), every collective raises an
    error that is both tf.errors.InvalidArgumentError and fx.FastxferError, and the next collective
    works; Horovod's repr; removed and duplicate sets."""
    r = hvd.rank()
    expect(repr(even) == str(even) == "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)", repr(even))
    expect(str(htf.global_process_set) == "ProcessSet(process_set_id=0, ranks=[0, 1, 2], mpi_comm=None)",
           str(htf.global_process_set))
    expect([(p.included(), p.rank(), p.size()) for p in (even, odd)] ==
           {0: [(True, 0, 2), (False, None, 1)], 1: [(False, None, 2), (True, 0, 1)],
            2: [(True, 1, 2), (False, None, 1)]}[r], "included()/rank()/size()")

    # DistributedGradientTape(process_set=even) on every rank: d/dw sum(w * c) = c, c = (r+1)^2 * [1, 2, 3];
    # ranks 0 and 2 average theirs, (1 + 9) / 2 = 5; rank 1 keeps its own, 4 -- eagerly and traced
    c = tf.constant(np.array([1, 2, 3], np.float32) * (r + 1) ** 2)
    want = np.array([1, 2, 3], np.float32) * (4 if r == 1 else 5)
    v = tf.Variable(np.ones(3, np.float32))

    def tape_grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * c)
        return htf.DistributedGradientTape(tape, process_set=even).gradient(loss, [v])[0]

    for how, g in (("eager", tape_grad()), ("function", tf.function(tape_grad)())):
        expect(np.array_equal(g.numpy(), want), f"tape {how}: {g.numpy()} != {want}")

    # DistributedOptimizer(process_set=even) on every rank: one SGD step (lr 1/8) of y = x w from
    # w = 0 on a batch of 4, mse: g = -2/4 X^T y. Small integers: every value is exact in float32.
    xs = np.array([[[1, 2], [0, 1], [2, 0], [1, 1]], [[3, 0], [1, 2], [0, 0], [2, 1]],
                   [[0, 1], [1, 0], [1, 3], [2, 2]]], np.float32)
    ys = np.array([[1, 2, 0, 3], [2, 1, 1, 0], [3, 0, 1, 2]], np.float32)[..., None]
    grads = [-0.5 * xs[q].astype(np.float64).T @ ys[q] for q in range(3)]
    step = {1: grads[1]}.get(r, (grads[0] + grads[2]) / 2)
    want_w = (-0.125 * step).astype(np.float32)

    def fresh_model():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False,
                                                                        kernel_initializer="zeros")])
        return model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.125), process_set=even)

    for run_eagerly in (False, True):
        model, opt = fresh_model()
        model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
        model.fit(xs[r], ys[r], batch_size=4, epochs=1, verbose=0, shuffle=False)
        got = model.weights[0].numpy()
        expect(np.array_equal(got, want_w), f"model.fit (run_eagerly={run_eagerly}): {got.ravel()} != "
                                            f"{want_w.ravel()}")
    model, opt = fresh_model()
    x_t, y_t = tf.constant(xs[r]), tf.constant(ys[r])

    def apply_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x_t) - y_t) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_weights), model.trainable_weights))

    apply_step()  # eagerly
    expect(np.array_equal(model.weights[0].numpy(), want_w), f"apply_gradients eager: {model.weights[0].numpy()}")
    tf.function(apply_step)()  # the second step, traced: w2 = w1 - lr * (the same rule at w1)
    w1 = want_w.astype(np.float64)
    g2 = [2 / 4 * xs[q].astype(np.float64).T @ (xs[q] @ w1 - ys[q]) for q in range(3)]
    want_w2 = w1 - 0.125 * {1: g2[1]}.get(r, (g2[0] + g2[2]) / 2)
    expect(np.array_equal(model.weights[0].numpy(), want_w2.astype(np.float32)),
           f"apply_gradients traced: {model.weights[0].numpy().ravel()} != {want_w2.ravel()}")

    # every collective on a set this rank is not in: InvalidArgumentError and FastxferError, eagerly
    # and in a tf.function, and the next collective works
    outside = odd if r != 1 else even
    t = tf.constant(np.arange(4, dtype=np.float32))
    kinds = {"allreduce": lambda: htf.allreduce(t, process_set=outside),
             "grouped_allreduce": lambda: htf.grouped_allreduce([t, t], process_set=outside),
             "allgather": lambda: htf.allgather(t, process_set=outside),
             "grouped_allgather": lambda: htf.grouped_allgather([t], process_set=outside),
             "broadcast": lambda: htf.broadcast(t, root_rank=outside.ranks[0], process_set=outside),
             "alltoall": lambda: htf.alltoall(t, process_set=outside),
             "reducescatter": lambda: htf.reducescatter(t, process_set=outside),
             "grouped_reducescatter": lambda: htf.grouped_reducescatter([t], process_set=outside)}
    text = f"rank {r} is not in {outside!r}: only its ranks may run its collectives"
    for kind, call in kinds.items():
        for how, fn in (("eager", call), ("function", tf.function(call))):
            e = raised(fn)
            expect(isinstance(e, tf.errors.InvalidArgumentError) and isinstance(e, fx.FastxferError)
                   and isinstance(e, fx.NotInProcessSetError) and text in str(e), f"{kind} {how}: {e!r}")
    e = raised(lambda: htf.broadcast_variables([v], root_rank=outside.ranks[0], process_set=outside))
    expect(isinstance(e, tf.errors.InvalidArgumentError) and isinstance(e, fx.FastxferError), f"broadcast_variables: {e!r}")
    e = raised(lambda: htf.allgather_object(r, process_set=outside))
    expect(isinstance(e, tf.errors.InvalidArgumentError) and isinstance(e, fx.FastxferError), f"allgather_object: {e!r}")
    expect(np.array_equal(htf.allreduce(t, op=htf.Sum).numpy(), 3 * np.arange(4, dtype=np.float32)),
           "the next collective after the errors")

    # a set with the ranks of a registered one: ValueError (Horovod); the global set cannot be removed
    expect_raises(ValueError, lambda: htf.add_process_set([2, 0]), "a process set with ranks")
    expect_raises(ValueError, lambda: htf.remove_process_set(htf.global_process_set), "cannot be removed")
    # removed: every call on it names its id, as fastxfer's error and InvalidArgumentError (and a
    # ValueError); removing twice is refused; ids are not reused
    pair = htf.add_process_set([1, 2])
    expect(pair.process_set_id == 3, pair)
    traced = tf.function(lambda: htf.allreduce(t, op=htf.Sum, process_set=pair))
    if pair.included():
        expect(np.array_equal(traced().numpy(), 2 * np.arange(4, dtype=np.float32)), "pair before removal")
    expect(htf.remove_process_set(pair) is True, "removed")
    removed = "process set 3 (ranks [1, 2]) was removed by remove_process_set"
    for how, fn in (("eager", lambda: htf.allreduce(t, process_set=pair)),
                    ("function", tf.function(lambda: htf.allgather(t, process_set=pair))),
                    ("tape", lambda: htf.DistributedGradientTape(tf.GradientTape(), process_set=pair))):
        e = raised(fn)
        expect(isinstance(e, tf.errors.InvalidArgumentError) and isinstance(e, fx.ProcessSetRemovedError)
               and isinstance(e, ValueError) and removed in str(e), f"{how}: {e!r}")
    # the function traced before the removal (on ranks 1 and 2; rank 0 traces it now): its ops name the id
    e = raised(traced)
    expect(isinstance(e, (tf.errors.InvalidArgumentError, ValueError)) and "process set 3" in str(e)
           and "removed" in str(e), f"traced before removal: {e!r}")
    expect_raises(fx.ProcessSetRemovedError, lambda: htf.remove_process_set(pair), "was removed already")
    again = htf.add_process_set([1, 2])
    expect(again.process_set_id == 4, again)
    expect(htf.remove_process_set(again) is True, "removed again")


def leaves():
    """Rank 1 fails (an exception) while rank 2 waits for it in their set and rank 0 in the global
    set: at exit rank 1's set engine leaves without waiting for its peers, so rank 2 fails at once
    instead of both waiting out FASTXFER_TIMEOUT in each other's engines."""
    import time

    fx.init()
    r = fx.rank()
    pair = fx.add_process_set([1, 2])  # positions 0 and 1 in the set: messages name ranks 1 and 2
    t0 = time.monotonic()
    if r == 1:
        raise RuntimeError("rank 1 gives up")
    try:
        if r == 2:
            fx.allreduce(np.ones(4), process_set=pair)
        else:
            fx.barrier()
    except fx.FastxferError as e:
        print(f"FAILED rank {r} after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        sys.exit(7)


def set_segments() -> list[str]:
    """The shared-memory files this process maps whose name is a process set's (``-s<id>-``)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split()[5] for line in f if len(line.split()) > 5 and "fastxfer-" in line
                       and "-s" in os.path.basename(line.split()[5])})


def names():
    """Issue 34 row 2: a set's segment name is 128 fresh random bits, not derived from the job
    segment's name (which another local user sees in /dev/shm): files planted at every name the old
    scheme would use do not stop add_process_set, and the same ranks registered twice get unrelated
    names."""
    import re

    r = fx.rank()
    job = group.layout().segment
    if r == 0:  # what an attacker who lists /dev/shm could create under the old scheme: <job>-s<id>r<first>
        for pid in (1, 2):
            for first in range(3):
                fd = os.open(f"{job}-s{pid}r{first}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                os.close(fd)
    fx.barrier()
    seen = []
    for pid in (1, 2):
        pair = fx.add_process_set([1, 2])
        expect(pair.process_set_id == pid, pair)
        if r in (1, 2):
            expect(np.array_equal(fx.allreduce(np.full(3, r, np.int32), op="sum", process_set=pair), [3, 3, 3]), "pair sum")
            maps = set_segments()
            expect(len(maps) == 1, maps)
            m = re.fullmatch(re.escape(job) + rf"-s{pid}-([0-9a-f]{{32}})", maps[0])
            expect(m is not None, (maps, job))
            seen.append(m[1])
        fx.remove_process_set(pair)
    if r in (1, 2):
        expect(len(set(seen)) == 2, seen)
        both = fx.allgather_object(seen)  # the set's ranks use the same name; outside ranks report none
        expect(both[1] == both[2] and both[0] == [], both)
    else:
        fx.allgather_object([])
    if r == 0:
        for pid in (1, 2):
            for first in range(3):
                os.unlink(f"{job}-s{pid}r{first}")


def removal_in_flight():
    """Issue 34 row 9: remove_process_set while only rank 1 has a request in flight on the set. Every
    rank raises the same MismatchError naming the request, the set is removed on every rank all the
    same (its collectives then raise ProcessSetRemovedError), and the same ranks register again."""
    r = fx.rank()
    pair = fx.add_process_set([1, 2])
    pid = pair.process_set_id
    pending = fx.allreduce_async(np.ones(4, np.float32), name="lonely", process_set=pair) if r == 1 else None
    e = raised(lambda: fx.remove_process_set(pair))
    expect(isinstance(e, fx.MismatchError), repr(e))
    expect(str(e).startswith(f"remove_process_set: process set {pid} (ranks [1, 2]) is removed, but its ranks had not run "
                              "the same collectives on it (") and "rank 1 still submitted allreduce 'lonely'" in str(e),
           str(e))
    if r == 1:
        e = raised(pending.wait)
        expect(isinstance(e, fx.FastxferError), repr(e))
    expect(pair.process_set_id is None and pair.removed_id == pid, repr(pair))
    expect(isinstance(raised(lambda: fx.allreduce(np.ones(2), process_set=pair)), fx.ProcessSetRemovedError),
           "a removed set's collectives")
    expect(fx.remove_process_set(fx.ProcessSet([1, 2])) is False, "nothing left registered for [1, 2]")
    again = fx.add_process_set([1, 2])
    expect(again.process_set_id == pid + 1, again)
    if r in (1, 2):
        expect(np.array_equal(fx.allreduce(np.full(2, r, np.int32), op="sum", process_set=again), [3, 3]), "re-added set")
    expect(fx.remove_process_set(again) is True, "removed")
    expect(np.array_equal(fx.allreduce(np.ones(2), op="sum"), [3.0, 3.0]), "the global set")


def registry():
    fx.init()
    r = fx.rank()
    names()
    removal_in_flight()
    fx.shutdown()
    print(f"OK registry rank {r}", flush=True)


def hosts():
    """Under mpirun, 4 ranks on 2 emulated hosts (FASTXFER_HOST_ID = rank // 2): a set across the
    hosts (MPI between them), a set inside one host (shared memory only), and a set with 2 ranks on
    one host and 1 on the other, which the hierarchical transport refuses on every rank."""
    fx.init()
    r, n = fx.rank(), fx.size()
    expect(n == 4 and group.layout().hosts == 2, group.layout())
    across = [fx.add_process_set([0, 2]), fx.add_process_set([1, 3])]
    inside = fx.add_process_set([0, 1])
    expect_raises(ValueError, lambda: fx.add_process_set([0, 1, 2]), "host 0: 2, host 1: 1")
    mine = across[r % 2]
    x = np.arange(6, dtype=np.float32) * (r + 1)
    expect(np.array_equal(fx.allreduce(x, op="sum", process_set=mine),
                          np.arange(6, dtype=np.float32) * sum(q + 1 for q in mine.ranks)), "sum across hosts")
    g = fx.allgather(np.full((r + 1, 2), r, np.int32), process_set=mine)
    expect(np.array_equal(g, np.concatenate([np.full((q + 1, 2), q, np.int32) for q in mine.ranks])), g)
    root = mine.ranks[1]
    expect(np.array_equal(fx.broadcast(x, root=root, process_set=mine), np.arange(6, dtype=np.float32) * (root + 1)),
           "broadcast across hosts")
    expect(fx.oob_allreduce(np.array([float(r)]), op="max", process_set=mine)[0] == float(mine.ranks[1]), "oob")
    if r in inside.ranks:
        expect(np.array_equal(fx.allreduce(x, op="average", process_set=inside),
                              np.arange(6, dtype=np.float32) * 1.5), "average inside host 0")
    expect(np.array_equal(fx.allreduce(x, op="sum"), np.arange(6, dtype=np.float32) * 10), "global set")
    # Horovod's communicator form: each rank passes its own half of a split; one id, two groups
    from mpi4py import MPI

    for ps in across + [inside]:
        fx.remove_process_set(ps)
    split = fx.add_process_set(fx.ProcessSet(MPI.COMM_WORLD.Split(color=r % 2, key=r)))
    expect(split.process_set_id == 4 and split.ranks == [r % 2, r % 2 + 2], split)
    expect((split.included(), split.rank(), split.size()) == (True, r // 2, 2), "a communicator's set's queries")
    expect(repr(split).startswith(f"ProcessSet(process_set_id=4, ranks={[r % 2, r % 2 + 2]}, mpi_comm=<"), repr(split))
    expect(np.array_equal(fx.allgather(np.array([r]), process_set=split), [r % 2, r % 2 + 2]), "split allgather")
    # {0} and {1, 2, 3}: the second group has 1 rank on host 0 and 2 on host 1, refused on every rank
    uneven = fx.ProcessSet(MPI.COMM_WORLD.Split(color=0 if r == 0 else 1, key=r))
    expect_raises(ValueError, lambda: fx.add_process_set(uneven), "[1, 2, 3] has different numbers of ranks on its "
                  "hosts (host 0: 1, host 1: 2)")
    fx.shutdown()
    print(f"OK hosts rank {r}", flush=True)


{"numpy": numpy_sets, "mismatch": mismatch, "tensorflow": tensorflow_sets, "hosts": hosts,
 "leaves": leaves, "registry": registry}[MODE]()
