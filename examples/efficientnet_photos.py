"""Workload 2: EfficientNet-B0 on the packed JPEG pipeline (the AWS case), two workers.

The data are JPEGs this example builds from the eight photographs that ship with scikit-image
(astronaut, coffee, cat, rocket, ...): random crops of 60-100% of a photo, resized to 160x120
and encoded at quality 90. The task is to tell **which source photograph a random crop comes
from** (8 classes) -- an honest stand-in for an image-classification set, not a benchmark
anyone publishes. Training uses fastxfer.data's per-rank Loader (random-resized-crop, flip,
mixup with label smoothing), SyncBatchNormalization in place of every BatchNormalization,
bf16 gradient compression, linear learning-rate scaling with gradual warm-up, and optionally
bf16 mixed precision. (Keras's EfficientNet rescales its input by 1/255 itself; the loader's
normalised images just pass through that constant scaling.)

    python examples/efficientnet_photos.py                   # starts 2 workers itself
    fastxfer run -np 2 python examples/efficientnet_photos.py --worker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _common import relaunch


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--train-images", type=int, default=960)
    p.add_argument("--val-images", type=int, default=240)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for a global batch of 64 (scaled)")
    p.add_argument("--mixup", type=float, default=0.2)
    p.add_argument("--precision", choices=["float32", "bf16"], default="float32")
    p.add_argument("--bn-momentum", type=float, default=0.9,
                   help="batch-norm moving-average momentum (Keras's EfficientNet uses 0.99, which after ~100 "
                        "steps still weighs the initial statistics by 0.99^100 = 37%%; short runs need less)")
    p.add_argument("--json", help="write the result here (rank 0)")
    return p.parse_args(argv)


def build_sets(root: str, n_train: int, n_val: int) -> tuple[str, str]:
    """JPEG crops of the scikit-image photographs in class folders, packed with fastxfer.data."""
    from fastxfer.bench.pipeline import PHOTOS, make_set
    from fastxfer.data import pack

    out = []
    for split, n, seed in (("train", n_train, 1), ("val", n_val, 2)):
        jpegs = make_set(n, (120, 160), seed=seed)  # image i is a crop of PHOTOS[i % 8]
        items = []
        for i, data in enumerate(jpegs):
            d = os.path.join(root, split, PHOTOS[i % len(PHOTOS)])
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"{i:05d}.jpg")
            with open(path, "wb") as f:
                f.write(data)
            items.append((path, i % len(PHOTOS)))
        packed = os.path.join(root, f"{split}.fxpack")
        pack(items, packed, classes=list(PHOTOS), progress=False, source=f"skimage photos ({split})")
        out.append(packed)
    return out[0], out[1]


def sync_bn(keras, model, hvd, momentum):
    """The same network with every BatchNormalization replaced by SyncBatchNormalization."""
    def clone(layer):
        if type(layer) is keras.layers.BatchNormalization:
            return hvd.SyncBatchNormalization.from_config({**layer.get_config(), "momentum": momentum})
        return layer.__class__.from_config(layer.get_config())

    return keras.models.clone_model(model, clone_function=clone)


def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import fastxfer.keras as hvd
    from fastxfer.data import Loader

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.precision == "bf16":
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    root = hvd.broadcast_object(tempfile.mkdtemp(prefix="fastxfer-photos-") if rank == 0 else None)
    if rank == 0:
        t = time.perf_counter()
        build_sets(root, args.train_images, args.val_images)
        print(f"built {args.train_images} + {args.val_images} JPEGs from 8 scikit-image photographs in "
              f"{time.perf_counter() - t:.1f} s ({root})", flush=True)
    hvd.allreduce(np.zeros(1, np.float32), name="sets-ready")  # everyone waits for rank 0
    train = Loader(os.path.join(root, "train.fxpack"), args.batch_size, image_size=args.image_size, train=True,
                   mixup_alpha=args.mixup, label_smoothing=0.1, num_classes=8, seed=0)
    val = Loader(os.path.join(root, "val.fxpack"), args.batch_size, image_size=args.image_size, train=False,
                 label_smoothing=0.0, num_classes=8, seed=0)
    keras.utils.set_random_seed(0)
    base = keras.applications.EfficientNetB0(weights=None, input_shape=(args.image_size, args.image_size, 3),
                                             classes=8, classifier_activation=None)
    model = sync_bn(keras, base, hvd, args.bn_momentum)
    n_sync = sum(isinstance(layer, hvd.SyncBatchNormalization) for layer in model._flatten_layers())
    global_batch = args.batch_size * size
    lr = hvd.scale_lr(args.lr, global_batch, base_batch=64)
    schedule = hvd.schedules.WarmupSchedule(lr, warmup_steps=len(train))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(schedule, momentum=0.9), compression=hvd.Compression.bf16)
    model.compile(optimizer=opt, loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    if rank == 0:
        print(f"EfficientNet-B0 ({model.count_params() / 1e6:.1f}M parameters, {n_sync} SyncBatchNormalization "
              f"layers), {size} workers x batch {args.batch_size}, lr {lr:.3g} with a {len(train)}-step warm-up, "
              f"mixup {args.mixup}, bf16 gradients, {args.precision} compute", flush=True)

    t0 = time.perf_counter()
    hist = model.fit(train.as_keras(), epochs=args.epochs, verbose=2 if rank == 0 else 0,
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvd.callbacks.MetricAverageCallback()])
    train_s = time.perf_counter() - t0
    # every rank evaluates its shard of the validation set; the accuracies are averaged
    xs, ys = zip(*(val.batch(b) for b in range(len(val))))
    pred = np.argmax(model.predict(np.concatenate(xs), batch_size=args.batch_size, verbose=0), axis=1)
    correct, total = int((pred == np.concatenate(ys)).sum()), len(pred)
    counts = hvd.allreduce(np.array([correct, total], np.float64), op=hvd.Sum).numpy()
    acc = counts[0] / counts[1]
    images = args.epochs * len(train) * global_batch
    result = {"workers": size, "precision": args.precision, "val_accuracy": float(acc),
              "train_accuracy": float(hist.history["accuracy"][-1]), "train_s": train_s,
              "images_per_s": images / train_s, "epochs": args.epochs, "sync_bn_layers": n_sync}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
        print(f"validation accuracy (which photograph, 8 classes; chance 12.5%): {acc * 100:.1f}% on "
              f"{int(counts[1])} crops; training {train_s:.1f} s, {result['images_per_s']:.1f} images/s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    hvd.shutdown()  # collective: every rank is done with the files after it
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    return relaunch(__file__, args.workers)


if __name__ == "__main__":
    sys.exit(main())
