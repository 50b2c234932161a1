"""What Keras spends between epochs, by how `fit` is fed: arrays, a tf.data dataset, or one repeated
dataset with steps_per_epoch. Each variant runs in a fresh process bound to one core with the
thread settings `fastxfer run --bind socket` gives a worker on a 2-core machine, variants
alternating, and reports per variant the median of the per-epoch gaps (from `on_epoch_begin` to
the epoch's first `on_train_batch_begin`, epochs after the first) and of the training steps.

    python bench/keras_feed.py [--repeats 3] [--epochs 7] [--cpu 0]

The model is the main job's fine-tuning model (examples/transfer_mnist.py: augmentation, a small
convolutional backbone, a dense head; 1,000 images of 28x28, batch 32, validation on 500). The
README's main job feeds a repeated dataset (docs/keras.md, "Feeding fit").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

VARIANTS = ("arrays", "dataset", "repeated")
THREADS = {"OMP_NUM_THREADS": "1", "KMP_BLOCKTIME": "1", "TF_NUM_INTEROP_THREADS": "1",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


def one(variant: str, epochs: int) -> dict:
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x, y = rng.random((1000, 28, 28, 1), np.float32), rng.integers(0, 5, 1000)
    vx, vy = rng.random((500, 28, 28, 1), np.float32), rng.integers(0, 5, 500)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.RandomTranslation(0.1, 0.1), keras.layers.RandomRotation(0.05),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(5)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    gaps, steps = [], []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.t = epoch, time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            now = time.perf_counter()
            if batch == 0 and self.epoch > 0:
                gaps.append(now - self.t)
            self.t = now

        def on_train_batch_end(self, batch, logs=None):  # also makes Keras finish each step before the next
            if self.epoch > 0 or batch > 0:
                steps.append(time.perf_counter() - self.t)

    kw = dict(epochs=epochs, verbose=0, callbacks=[Clock()], validation_data=(vx, vy))
    if variant == "arrays":
        model.fit(x, y, batch_size=32, **kw)
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0, reshuffle_each_iteration=True)
        if variant == "dataset":
            model.fit(ds.batch(32).prefetch(2), **kw)
        else:
            model.fit(ds.batch(32).repeat().prefetch(2), steps_per_epoch=-(-len(x) // 32), **kw)
    return {"variant": variant, "gap_ms": statistics.median(gaps) * 1e3, "gaps_ms": [g * 1e3 for g in gaps],
            "step_ms": statistics.median(steps) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=7)
    p.add_argument("--cpu", type=int, default=0, help="the core each run is bound to")
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.epochs)), flush=True)
        return 0
    runs = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for v in VARIANTS if rep % 2 == 0 else reversed(VARIANTS):
            cmd = ["taskset", "-c", str(args.cpu), sys.executable, os.path.abspath(__file__), "--one", v,
                   "--epochs", str(args.epochs)]
            r = subprocess.run(cmd, env={**os.environ, **THREADS}, capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                raise SystemExit(f"{v} failed (exit code {r.returncode}):\n{r.stderr[-2000:]}")
            res = json.loads(line[0][7:])
            runs[v].append(res)
            print(f"run {rep + 1} {v:9s} gaps (ms): {', '.join(f'{g:.0f}' for g in res['gaps_ms'])}; "
                  f"step {res['step_ms']:.1f} ms", flush=True)
    print("\n| fed with | gap before an epoch's first step, ms (median of runs) | training step, ms |")
    print("|---|---|---|")
    for v in VARIANTS:
        gaps = [r["gap_ms"] for r in runs[v]]
        listed = ", ".join(f"{g:.0f}" for g in gaps)
        print(f"| {v} | {statistics.median(gaps):.0f} (runs: {listed}) | "
              f"{statistics.median(r['step_ms'] for r in runs[v]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
