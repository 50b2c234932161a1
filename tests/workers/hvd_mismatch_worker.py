"""Worker for tests/multiproc/test_horovod_parity.py: for every Horovod collective name, ranks
that disagree (dtype, shape, op, root, name, count) get MismatchError on every rank -- eagerly and
inside a tf.function. Each case runs in a fresh process set of both ranks, so the set's engine
fails and the job goes on to the next case (process sets: tests/multiproc/test_process_sets.py).

Prints 'OK mismatches rank R: N cases' when every case raised on this rank, with the message
naming the disagreement."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer as fx  # noqa: E402
import fastxfer.tensorflow as hvd  # noqa: E402

hvd.init()
r = hvd.rank()
other = 1 - r


def f32(*shape, dtype=np.float32):
    return tf.constant(np.ones(shape, dtype))


VB = tf.Variable(np.ones(3 + r, np.float32))  # variables exist before any tf.function traces
W = tf.Variable(np.ones((3, 1 + r), np.float32), name="w")

CASES = {
    # name: (call(process_set), text the message must contain)
    "allreduce dtype": (lambda ps: hvd.allreduce(f32(4, dtype=np.float32 if r == 0 else np.float64), name="a",
                                                 process_set=ps), "float64[4]"),
    "allreduce op": (lambda ps: hvd.allreduce(f32(4), op=hvd.Sum if r == 0 else hvd.Max, name="a", process_set=ps),
                     "allreduce 'a' float32[4]"),
    "allreduce Product": (lambda ps: hvd.allreduce(f32(4), op=hvd.Product if r == 0 else hvd.Sum, name="a",
                                                   process_set=ps), "product"),
    "allreduce int8/uint8": (lambda ps: hvd.allreduce(f32(4, dtype=np.int8 if r == 0 else np.uint8), op=hvd.Sum,
                                                      name="a", process_set=ps), "uint8[4]"),
    "grouped_allreduce": (lambda ps: hvd.grouped_allreduce([f32(2), f32(3 + r)], name="g", process_set=ps),
                          "float32[4]"),
    "allgather": (lambda ps: hvd.allgather(f32(2, 3 + r), name="ag", process_set=ps), "float32[2,4]"),
    "grouped_allgather": (lambda ps: hvd.grouped_allgather([f32(2), f32(2, dtype=np.int32 if r else np.int64)],
                                                           name="gg", process_set=ps), "int32"),
    "broadcast root": (lambda ps: hvd.broadcast(f32(3), root_rank=r, name="b", process_set=ps), "root"),
    "alltoall": (lambda ps: hvd.alltoall(f32(2, 2, dtype=np.float32 if r == 0 else np.int32), name="t",
                                         process_set=ps), "int32[2,2]"),
    "reducescatter": (lambda ps: hvd.reducescatter(f32(4, 2 + r), op=hvd.Sum, name="rs", process_set=ps),
                      "float32[4,3]"),
    "grouped_reducescatter": (lambda ps: hvd.grouped_reducescatter([f32(4, 2)], op=hvd.Sum if r == 0 else hvd.Average,
                                                                   process_set=ps), "reducescatter"),
    "broadcast_variables": (lambda ps: hvd.broadcast_variables([VB], root_rank=0, process_set=ps), "float32[4]"),
    "sparse allreduce": (lambda ps: hvd.allreduce(tf.IndexedSlices(f32(2, 3 + r), tf.constant([0, 1]),
                                                                   tf.constant([5, 3 + r])), name="s",
                                                  process_set=ps), "float32[2,4]"),
    "DistributedGradientTape": (lambda ps: _tape(ps), "DistributedGradientTape"),
}
EAGER_ONLY = {
    "allgather_object": (lambda ps: hvd.allgather_object(r, name=f"obj{r}", process_set=ps), "obj1"),
    "broadcast_object": (lambda ps: hvd.broadcast_object(r, root_rank=0, name=f"bobj{r}", process_set=ps), "bobj1"),
}


def _tape(ps):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(W * 2.0)
    return hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [W])


def run_case(label, call, text):
    ps = hvd.add_process_set([0, 1])
    try:
        call(ps)
    except fx.MismatchError as e:
        msg = str(e)
    except tf.errors.OpError as e:  # inside a tf.function: TensorFlow's op error, fastxfer's class first
        msg = e.message
        if "MismatchError: " not in msg:
            raise AssertionError(f"{label}: {type(e).__name__} is not a MismatchError: {msg}") from None
    else:
        raise AssertionError(f"{label}: ranks disagreed and nothing was raised")
    if text not in msg or f"rank {other}" not in msg:
        raise AssertionError(f"{label}: the message does not name the disagreement ({text!r}, rank {other}): {msg}")
    hvd.remove_process_set(ps)


def traced(call, ps):
    @tf.function
    def fn():
        call(ps)  # stateful ops run without being returned (broadcast_variables returns an op)

    fn()


n = 0
for label, (call, text) in CASES.items():
    run_case(f"{label} (eager)", call, text)
    run_case(f"{label} (tf.function)", lambda ps, call=call: traced(call, ps), text)
    n += 2
for label, (call, text) in EAGER_ONLY.items():
    run_case(label, call, text)
    n += 1
# the job itself is unharmed: a global allreduce still sums
assert np.array_equal(hvd.allreduce(f32(2), op=hvd.Sum).numpy(), [2.0, 2.0])
print(f"OK mismatches rank {r}: {n} cases", flush=True)
