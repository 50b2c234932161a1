"""The tf.data peer of ``fastxfer bench pipeline``: the equivalent tf.data input pipeline
(decode_and_crop_jpeg with sample_distorted_bounding_box, resize, flip, normalise) on one thread,
in a process of its own so that its thread settings are its own.

It answers the driver over stdin/stdout, so the driver can interleave it with the other
pipelines: after a warm-up pass it prints ``READY <tf version>``, then for each ``run`` line on
stdin times one pass over the files and prints ``{"seconds": ..., "cpu_seconds": ...}``.

``python -m fastxfer.bench.workers.pipeline_worker --files LIST.json [--train]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def cpu_seconds() -> float:
    """CPU time of the whole process, TensorFlow's threads included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dataset(files: list[str], train: bool):
    import tensorflow as tf

    data = []
    for path in files:
        with open(path, "rb") as f:
            data.append(f.read())
    mean = tf.constant([0.485, 0.456, 0.406]) * 255
    std = tf.constant([0.229, 0.224, 0.225]) * 255

    def train_map(b):
        shape = tf.io.extract_jpeg_shape(b)
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, tf.zeros([0, 0, 4]), min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
        img = tf.io.decode_and_crop_jpeg(b, window, channels=3)
        img = tf.image.resize(img, (224, 224), method="bilinear")
        img = tf.image.random_flip_left_right(img)
        return (img - mean) / std

    def eval_map(b):
        s = tf.io.extract_jpeg_shape(b)
        side = tf.cast(tf.cast(tf.minimum(s[0], s[1]), tf.float32) * 0.875, tf.int32)
        window = tf.stack([(s[0] - side) // 2, (s[1] - side) // 2, side, side])
        img = tf.io.decode_and_crop_jpeg(b, window, channels=3)
        img = tf.image.resize(img, (224, 224), method="bilinear")
        return (img - mean) / std

    ds = tf.data.Dataset.from_tensor_slices(data).map(train_map if train else eval_map, num_parallel_calls=1).batch(32)
    opts = tf.data.Options()
    opts.threading.private_threadpool_size = 1
    opts.autotune.enabled = False
    return ds.with_options(opts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.workers.pipeline_worker", description=__doc__)
    ap.add_argument("--files", required=True, help='JSON file {"files": [JPEG paths]}')
    ap.add_argument("--train", action="store_true", help="the training pipeline (default: evaluation)")
    a = ap.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    with open(a.files) as f:
        ds = dataset(json.load(f)["files"], a.train)

    def one_pass():
        for _ in ds:
            pass
    one_pass()  # warm-up (tracing)
    print("READY " + tf.__version__, flush=True)
    for line in sys.stdin:  # one timed pass per request, so the driver can interleave the peers
        if line.strip() != "run":
            break
        c0, t0 = cpu_seconds(), time.perf_counter()
        one_pass()
        t = time.perf_counter() - t0
        print(json.dumps({"seconds": t, "cpu_seconds": cpu_seconds() - c0}), flush=True)


if __name__ == "__main__":
    main()
