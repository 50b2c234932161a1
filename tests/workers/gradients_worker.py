"""Gradients through the public collectives (Horovod's definitions: fastxfer/tensorflow/gradients.py),
each checked against its exact value on every rank, eagerly and in a tf.function, on the whole job
and in a process set. Prints `OK gradients rank R` on success."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fastxfer.tensorflow as hvd  # noqa: E402


def checks(r, n, ps, tag):
    """(name, function of nothing that returns (gradient, expected)) for one process set."""
    idx = ps.ranks.index(r) if ps is not hvd.global_process_set else r
    m = ps.size() if ps is not hvd.global_process_set else n
    c, d = float(idx + 1), float(2 * idx + 1)  # this rank's factors; sum(d) = m*m, mean(d) = m

    def allreduce(op, want):
        x = tf.Variable(tf.ones([3]))

        def run():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(hvd.allreduce(x * c, op=op, process_set=ps, name=f"ar.{tag}") * d)
            return tape.gradient(loss, x)
        return run, np.full(3, want, np.float32)

    def grouped():
        a, b = tf.Variable(tf.ones([2])), tf.Variable(tf.ones([4]))

        def run():
            with tf.GradientTape() as tape:
                ya, yb = hvd.grouped_allreduce([a * c, b * 2 * c], op=hvd.Sum, process_set=ps)
                loss = tf.reduce_sum(ya * d) + tf.reduce_sum(yb * d)
            ga, gb = tape.gradient(loss, [a, b])
            return tf.concat([ga, gb], 0)
        return run, np.array([m * m * c] * 2 + [2 * m * m * c] * 4, np.float32)

    def allgather():
        x = tf.Variable(tf.ones([idx + 1, 2]))  # first dimensions differ between ranks

        def run():
            with tf.GradientTape() as tape:
                y = hvd.allgather(x, process_set=ps)
                loss = tf.reduce_sum(y * c)  # each rank weighs every gathered row by its own factor
            return tape.gradient(loss, x)
        return run, np.full((idx + 1, 2), (m + 1) / 2, np.float32)  # the Average of the factors, this rank's rows

    def broadcast():
        root = ps.ranks[-1] if ps is not hvd.global_process_set else n - 1
        x = tf.Variable(tf.ones([3]))

        def run():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(hvd.broadcast(x * c, root_rank=root, process_set=ps) * c)
            return tape.gradient(loss, x)
        # on the root: the Average of every rank's factor, times the root's own factor (m); else 0
        return run, np.full(3, (m + 1) / 2 * m if r == root else 0.0, np.float32)

    return [("allreduce-average", lambda: allreduce(hvd.Average, m * c)),
            ("allreduce-sum", lambda: allreduce(hvd.Sum, m * m * c)),
            ("grouped", grouped), ("allgather", allgather), ("broadcast", broadcast)]


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sets = [hvd.global_process_set]
    sub = hvd.add_process_set([0, n - 1]) if n > 2 else None
    if sub is not None:
        sets.append(sub)
    for si, ps in enumerate(sets):
        if ps is not hvd.global_process_set and not ps.included():
            continue
        for name, make in checks(r, n, ps, si):
            for mode in ("eager", "function"):
                run, want = make()
                got = (run() if mode == "eager" else tf.function(run)()).numpy()
                if not np.array_equal(got, want):
                    raise AssertionError(f"{name} {mode} set {ps.ranks if si else 'all'}: got {got}, want {want}")
    print(f"OK gradients rank {r}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
