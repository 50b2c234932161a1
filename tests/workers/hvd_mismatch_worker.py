"""Worker for tests/multiproc/test_horovod_parity.py (2 and 3 ranks): for every Horovod collective
name, ranks that disagree on its contents (dtype, shape, op, root) make that one collective fail on
every rank, eagerly and inside a tf.function, with Horovod's error class and fastxfer's -- and the
very next collective of the same kind, on the same set and under the same name, works (exact
values). Rank 0 disagrees with the others.

Eagerly the error is both fx.MismatchError and tf.errors.FailedPreconditionError; in a
tf.function TensorFlow raises tf.errors.FailedPreconditionError whose message holds
"MismatchError: " (UnknownError through the numpy_function bridge). Collectives whose ranks disagree on their *names* cannot be matched (each rank
waits for a collective the others never submit): they poison their set, so those cases run in a
fresh process set each, and the job goes on.

Prints 'OK mismatches rank R: N cases' when every case raised on this rank with a message naming
the disagreement, and every next collective gave the exact result."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer as fx  # noqa: E402
import fastxfer.tensorflow as hvd  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
odd = int(r > 0)  # rank 0 disagrees with the rest
GLOBAL = hvd.global_process_set


def ones(*shape, dtype=np.float32):
    return tf.constant(np.ones(shape, dtype))


VB = tf.Variable(np.ones(3 + odd, np.float32))  # variables exist before any tf.function traces
VG = tf.Variable(np.full(3, float(r), np.float32))
W = tf.Variable(np.ones((3, 1 + odd), np.float32), name="w")
W2 = tf.Variable(np.ones((3, 2), np.float32), name="w2")


def _tape(ps, var):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * 2.0)
    return hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [var])[0]


def _broadcast_variables(ps):
    op = hvd.broadcast_variables([VG], root_rank=n - 1, process_set=ps)
    with tf.control_dependencies([] if tf.executing_eagerly() or op is None else [op]):
        return VG.read_value()


def _alltoall_in():
    return tf.constant([[10.0 * r + j] * 2 for j in range(n)], tf.float32)


ALLGATHERED = np.concatenate([np.full((1, 3), float(j), np.float32) for j in range(n)])
SCATTER_SUM = np.full((2, 2), n * (n + 1) / 2, np.float32)

CASES = {
    # name: (the call on which ranks disagree, text its message must contain,
    #        the same kind of call on which they agree, its exact result on this rank)
    "allreduce dtype": (lambda ps: hvd.allreduce(ones(4, dtype=np.float64 if odd else np.float32), name="a",
                                                 process_set=ps), "float64[4]",
                        lambda ps: hvd.allreduce(ones(4), op=hvd.Sum, name="a", process_set=ps), np.full(4, n)),
    "allreduce op": (lambda ps: hvd.allreduce(ones(4), op=hvd.Max if odd else hvd.Sum, name="a", process_set=ps),
                     "allreduce 'a' float32[4]",
                     lambda ps: hvd.allreduce(ones(4) * (r + 1), op=hvd.Max, name="a", process_set=ps), np.full(4, n)),
    "allreduce Product": (lambda ps: hvd.allreduce(ones(4), op=hvd.Sum if odd else hvd.Product, name="a",
                                                   process_set=ps), "product",
                          lambda ps: hvd.allreduce(ones(4) * 2, op=hvd.Product, name="a", process_set=ps),
                          np.full(4, 2 ** n)),
    "allreduce int8/uint8": (lambda ps: hvd.allreduce(ones(4, dtype=np.uint8 if odd else np.int8), op=hvd.Sum,
                                                      name="a", process_set=ps), "uint8[4]",
                             lambda ps: hvd.allreduce(ones(4, dtype=np.int8), op=hvd.Sum, name="a", process_set=ps),
                             np.full(4, n, np.int8)),
    "grouped_allreduce": (lambda ps: hvd.grouped_allreduce([ones(2), ones(3 + odd)], name="g", process_set=ps),
                          "float32[4]",
                          lambda ps: hvd.grouped_allreduce([ones(2), ones(3) * r], op=hvd.Sum, name="g",
                                                           process_set=ps)[1], np.full(3, n * (n - 1) / 2)),
    "allgather": (lambda ps: hvd.allgather(ones(2, 3 + odd), name="ag", process_set=ps), "float32[2,4]",
                  lambda ps: hvd.allgather(tf.fill([1, 3], float(r)), name="ag", process_set=ps), ALLGATHERED),
    "grouped_allgather": (lambda ps: hvd.grouped_allgather([ones(2), ones(2, dtype=np.int32 if odd else np.int64)],
                                                           name="gg", process_set=ps), "int32",
                          lambda ps: hvd.grouped_allgather([ones(2), tf.fill([1, 3], float(r))], name="gg",
                                                           process_set=ps)[1], ALLGATHERED),
    "broadcast root": (lambda ps: hvd.broadcast(ones(3), root_rank=odd, name="b", process_set=ps), "root",
                       lambda ps: hvd.broadcast(tf.fill([3], float(r)), root_rank=n - 1, name="b", process_set=ps),
                       np.full(3, n - 1)),
    "alltoall": (lambda ps: hvd.alltoall(ones(n, 2, dtype=np.int32 if odd else np.float32), name="t", process_set=ps),
                 f"int32[{n},2]",
                 lambda ps: hvd.alltoall(_alltoall_in(), name="t", process_set=ps),
                 np.array([[10.0 * j + r] * 2 for j in range(n)], np.float32)),
    "reducescatter": (lambda ps: hvd.reducescatter(ones(2 * n, 2 + odd), op=hvd.Sum, name="rs", process_set=ps),
                      f"float32[{2 * n},3]",
                      lambda ps: hvd.reducescatter(ones(2 * n, 2) * (r + 1), op=hvd.Sum, name="rs", process_set=ps),
                      SCATTER_SUM),
    "grouped_reducescatter": (lambda ps: hvd.grouped_reducescatter([ones(2 * n, 2)],
                                                                   op=hvd.Average if odd else hvd.Sum,
                                                                   process_set=ps), "reducescatter",
                              lambda ps: hvd.grouped_reducescatter([ones(2 * n, 2) * (r + 1)], op=hvd.Sum,
                                                                   process_set=ps)[0], SCATTER_SUM),
    "broadcast_variables": (lambda ps: hvd.broadcast_variables([VB], root_rank=0, process_set=ps), "float32[4]",
                            lambda ps: _broadcast_variables(ps),
                            np.full(3, n - 1)),
    "sparse allreduce": (lambda ps: hvd.allreduce(tf.IndexedSlices(ones(2, 3 + odd), tf.constant([0, 1]),
                                                                   tf.constant([5, 3 + odd])), name="s",
                                                  process_set=ps), "float32[2,4]",
                         lambda ps: hvd.allreduce(tf.IndexedSlices(ones(2, 3) * (r + 1), tf.constant([0, 1]),
                                                                   tf.constant([5, 3])), name="s",
                                                  process_set=ps).values,
                         np.concatenate([np.full((2, 3), (j + 1) / n, np.float32) for j in range(n)])),
    "DistributedGradientTape": (lambda ps: _tape(ps, W), "DistributedGradientTape",
                                lambda ps: _tape(ps, W2), np.full((3, 2), 2.0)),
}
NAMES_DIFFER = {  # ranks disagree on the collective's name: fails (and stops) the set, not the job
    "allgather_object": lambda ps: hvd.allgather_object(r, name=f"obj{odd}", process_set=ps),
    "broadcast_object": lambda ps: hvd.broadcast_object(r, root_rank=0, name=f"bobj{odd}", process_set=ps),
}


# In a tf.function, the numpy_function bridge (FASTXFER_TF_NATIVE=0) fails with UnknownError:
# tf.numpy_function gives every exception but a few builtins (ValueError, ...) that code.
GRAPH_ERROR = tf.errors.FailedPreconditionError if hvd.backend.use_native() else tf.errors.UnknownError


def expect_mismatch(label, call, text, in_graph):
    try:
        call()
    except tf.errors.OpError as e:
        if not isinstance(e, GRAPH_ERROR if in_graph else tf.errors.FailedPreconditionError):
            raise AssertionError(f"{label}: {type(e).__name__} raised") from None
        if in_graph:
            msg = e.message
            if "MismatchError: " not in msg:
                raise AssertionError(f"{label}: not fastxfer's MismatchError: {msg}") from None
        else:
            if not isinstance(e, fx.MismatchError):
                raise AssertionError(f"{label}: eagerly, {type(e).__mro__} is not also fx.MismatchError") from None
            msg = str(e)
    else:
        raise AssertionError(f"{label}: ranks disagreed and nothing was raised")
    if text not in msg or not ("rank 0" in msg and "rank 1" in msg):
        raise AssertionError(f"{label}: the message does not name the disagreement ({text!r}, ranks 0, 1): {msg}")


def traced(call, ps):
    @tf.function
    def fn():
        out = call(ps)  # stateful ops run without being returned (broadcast_variables returns an op)
        return None if isinstance(out, tf.Operation) else out

    return fn()


cases = 0
for label, (bad, text, good, want) in CASES.items():
    for in_graph in (False, True):
        run = (lambda f: (lambda: traced(f, GLOBAL))) if in_graph else (lambda f: (lambda: f(GLOBAL)))
        mode = "tf.function" if in_graph else "eager"
        expect_mismatch(f"{label} ({mode})", run(bad), text, in_graph)
        got = run(good)()
        got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
        if not np.array_equal(got, want):
            raise AssertionError(f"{label} ({mode}): the next collective gave {got}, want {want}")
        cases += 1
for label, call in NAMES_DIFFER.items():
    ps = hvd.add_process_set(list(range(n)))
    try:
        call(ps)
    except fx.MismatchError as e:
        if "rank" not in str(e):
            raise AssertionError(f"{label}: {e}") from None
    else:
        raise AssertionError(f"{label}: ranks disagreed and nothing was raised")
    hvd.remove_process_set(ps)
    cases += 1
# the job itself is unharmed
assert np.array_equal(hvd.allreduce(ones(2), op=hvd.Sum).numpy(), [n, n])
print(f"OK mismatches rank {r}: {cases} cases", flush=True)
