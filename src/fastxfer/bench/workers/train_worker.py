"""One worker of ``fastxfer bench train``: trains a keras.applications model on random data with
one intra-op thread and writes the per-step times of the timed steps to ``OUT.<rank>``.

``--kind fastxfer:<run>`` (under ``fastxfer run``; run = alone, alone-interop, wide (TensorFlow's
default threads, unbound), nocomm, none, bf16, fp16 or bf16-pin; ``--model tiny``: five Dense(16)
layers on 16 features, the fixed-cost model; fixed-ab: that model with and without communication in
alternating blocks of one job), ``--kind mwms --rank R`` (tf.distribute.MultiWorkerMirroredStrategy with
tf-keras, TF_CONFIG set by the driver) or ``--kind horovod`` (under horovodrun), e.g.
``python -m fastxfer.bench.workers.train_worker --kind fastxfer:bf16 --steps 20 --out /tmp/t``.
"""

from __future__ import annotations

import argparse
import os
import time

from fastxfer.bench.harness import write_result

NO_COMM = ("alone", "alone-interop", "nocomm", "wide")  # fastxfer runs without a DistributedOptimizer


def threads_one(inter_op: int | None = 1) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    if inter_op is not None:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def data(args, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    n = args.batch * (args.steps + args.warmup)
    if args.model == "tiny":
        return rng.random((n, 16), dtype=np.float32), rng.random((n, 16), dtype=np.float32)
    x = rng.random((n, args.image_size, args.image_size, 3), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    return x, y


def step_clock(keras_mod, times: list[float]):
    """A callback that appends each training step's wall time to `times`."""
    class Clock(keras_mod.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)
    return Clock()


def timed_fit(keras_mod, model, x, y, args) -> list[float]:
    """Fits warm-up steps, then the timed steps; returns per-step seconds."""
    times: list[float] = []
    w = args.warmup * args.batch
    model.fit(x[:w], y[:w], batch_size=args.batch, epochs=1, verbose=0, shuffle=False)
    model.fit(x[w:], y[w:], batch_size=args.batch, epochs=1, verbose=0, shuffle=False,
              callbacks=[step_clock(keras_mod, times)])
    return times


def tiny_model(keras_mod):
    return keras_mod.Sequential([keras_mod.Input((16,))] + [keras_mod.layers.Dense(16) for _ in range(5)])


def run_fixed_ab(args, hvd) -> None:
    """The fixed per-step cost, both sides in one job: the tiny model with a plain optimizer and
    the same model with fastxfer's (no compression), trained in alternating blocks of ``BLOCK``
    steps, so that both see the same minutes of this machine's drift (separate jobs a minute
    apart differed by more than the cost measured). The first step of each block is left out (the
    fit's start, and the ranks meeting again after a block without communication)."""
    import keras

    threads_one(1)
    models = {}
    for kind in ("nocomm", "none"):
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        models[kind] = tiny_model(keras)
        models[kind].compile(optimizer=opt if kind == "nocomm" else hvd.DistributedOptimizer(opt), loss="mse")
    hvd.broadcast_variables(models["none"].variables, root_rank=0)
    x, y = data(argparse.Namespace(model="tiny", batch=args.batch, steps=max(args.steps, BLOCK), warmup=args.warmup),
                hvd.rank())
    n = BLOCK * args.batch
    for m in models.values():
        m.fit(x[:args.warmup * args.batch], y[:args.warmup * args.batch], batch_size=args.batch, epochs=1,
              verbose=0, shuffle=False)
    times = {kind: [] for kind in models}
    for b in range(-(-args.steps // (BLOCK - 1))):
        for kind in (("nocomm", "none") if b % 2 == 0 else ("none", "nocomm")):
            t: list[float] = []
            models[kind].fit(x[:n], y[:n], batch_size=args.batch, epochs=1, verbose=0, shuffle=False,
                             callbacks=[step_clock(keras, t)])
            times[kind].extend(t[1:])
    write_result(args.out, hvd.rank(), {"rank": hvd.rank(), "times": times["none"],
                                        "times_nocomm": times["nocomm"]})


BLOCK = 26  # steps per block of run_fixed_ab (25 timed)


def run_fastxfer(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import fastxfer.keras as hvd

    hvd.init()
    kind = args.kind.split(":", 1)[1]
    if kind == "fixed-ab":
        run_fixed_ab(args, hvd)
        hvd.shutdown()
        return
    if kind.endswith("-pin"):
        kind = kind[:-len("-pin")]  # FASTXFER_TF_PIN=1 came in the environment
    if kind != "wide":
        threads_one(None if kind == "alone-interop" else 1)
    import keras

    if args.model == "tiny":
        model = tiny_model(keras)
        loss = "mse"
    else:
        model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.image_size,) * 2 + (3,),
                                                         classes=10)
        loss = "sparse_categorical_crossentropy"
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    if kind not in NO_COMM:
        opt = hvd.DistributedOptimizer(opt, compression=kind)
    model.compile(optimizer=opt, loss=loss)
    x, y = data(args, hvd.rank())
    if kind not in NO_COMM:
        hvd.broadcast_variables(model.variables, root_rank=0)
    times = timed_fit(keras, model, x, y, args)
    write_result(args.out, hvd.rank(), {"rank": hvd.rank(), "times": times})
    hvd.shutdown()


def run_mwms(args) -> None:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.sched_setaffinity(0, {args.rank % len(os.sched_getaffinity(0))} if len(os.sched_getaffinity(0)) > 1
                         else os.sched_getaffinity(0))
    import numpy as np
    import tensorflow as tf

    threads_one()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = getattr(tf.keras.applications, args.model)(weights=None,
                                                           input_shape=(args.image_size,) * 2 + (3,), classes=10)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    x, y = data(args, args.rank)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

    def ds(a, b):  # global batch = 2 x per-worker batch, each worker gets its half
        return tf.data.Dataset.from_tensor_slices((a, b)).batch(args.batch * 2).with_options(opts)

    times: list[float] = []
    x2, y2 = np.concatenate([x, x]), np.concatenate([y, y])
    w = args.warmup * args.batch * 2
    model.fit(ds(x2[:w], y2[:w]), epochs=1, verbose=0)
    model.fit(ds(x2[w:], y2[w:]), epochs=1, verbose=0, callbacks=[step_clock(tf.keras, times)])
    write_result(args.out, args.rank, {"rank": args.rank, "times": times})


def run_horovod(args) -> None:  # pragma: no cover - Horovod does not build against TF 2.21
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import horovod.tensorflow.keras as hvd

    hvd.init()
    threads_one()
    import tensorflow as tf

    model = getattr(tf.keras.applications, args.model)(weights=None, input_shape=(args.image_size,) * 2 + (3,),
                                                       classes=10)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    x, y = data(args, hvd.rank())
    times = timed_fit(tf.keras, model, x, y, args)
    write_result(args.out, hvd.rank(), {"rank": hvd.rank(), "times": times})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.workers.train_worker", description=__doc__)
    ap.add_argument("--kind", required=True, help="fastxfer:<run>, mwms or horovod")
    ap.add_argument("--rank", type=int, default=0, help="this worker's index (mwms only; the others ask their job)")
    ap.add_argument("--steps", type=int, required=True, help="timed steps")
    ap.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    ap.add_argument("--batch", type=int, required=True, help="per-worker batch")
    ap.add_argument("--image-size", type=int, required=True)
    ap.add_argument("--model", required=True, help="a keras.applications model name")
    ap.add_argument("--out", required=True, help="the per-step times go to OUT.<rank>")
    args = ap.parse_args(argv)
    if args.kind.startswith("fastxfer:"):
        run_fastxfer(args)
    elif args.kind == "mwms":
        run_mwms(args)
    elif args.kind == "horovod":
        run_horovod(args)
    else:
        ap.error(f"unknown --kind {args.kind!r}")


if __name__ == "__main__":
    main()
