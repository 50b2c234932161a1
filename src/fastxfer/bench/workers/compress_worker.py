"""The tf.cast peer of ``fastxfer bench compress``, in a process of its own because TensorFlow fixes
its thread pools at start-up: times float32 <-> bf16/fp16 casts with a given number of intra-op
threads and writes the medians, and a sample of the result bits to check, to ``OUT.0``.

``python -m fastxfer.bench.workers.compress_worker --threads 1 --elements N --reps 11 --out PATH``
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.workers.compress_worker", description=__doc__)
    ap.add_argument("--threads", type=int, required=True, help="TensorFlow intra-op threads")
    ap.add_argument("--elements", type=int, required=True, help="float32 elements to convert")
    ap.add_argument("--reps", type=int, required=True, help="timed repetitions (median reported)")
    ap.add_argument("--out", required=True, help="the result goes to OUT.0")
    a = ap.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    from fastxfer.bench.harness import median_seconds, write_result

    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    n = a.elements
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    t32 = tf.constant(x)
    tb, th = tf.cast(t32, tf.bfloat16), tf.cast(t32, tf.float16)
    stride = max(1, n // 65536)  # a sample of the bits is enough to count mismatches, scaled up by the driver
    write_result(a.out, 0, {
        "version": tf.__version__,
        "f32->bf16": median_seconds(lambda: tf.cast(t32, tf.bfloat16), a.reps),
        "f32->fp16": median_seconds(lambda: tf.cast(t32, tf.float16), a.reps),
        "bf16->f32": median_seconds(lambda: tf.cast(tb, tf.float32), a.reps),
        "fp16->f32": median_seconds(lambda: tf.cast(th, tf.float32), a.reps),
        "bits": {"f32->bf16": tb.numpy().view(np.uint16)[::stride].tolist(),
                 "f32->fp16": th.numpy().view(np.uint16)[::stride].tolist()}})


if __name__ == "__main__":
    main()
