"""``fastxfer bench train``: Keras ResNet-50 (weights=None, 32x32 inputs, so that a CPU step is
short and the 25.6M-parameter gradient dominates), per-worker batch 16, one intra-op thread per
worker; 1 worker vs 2 workers, side by side in one run:

- ``alone``: one worker, no communication, 1 intra-op and 1 inter-op thread (the reference for
  scaling efficiency: the same thread budget as each of the 2 workers); also shown with
  TensorFlow's default inter-op threads (it then uses both cores);
- ``no-comm``: 2 workers training independently (each bound to its own core): what the machine
  allows before any communication, i.e. the ceiling of scaling efficiency here;
- ``fastxfer none`` / ``fastxfer bf16``: 2 workers, ``fastxfer.keras.DistributedOptimizer``;
  also bf16 with ``FASTXFER_TF_PIN=1`` (submits pinned into the backward pass even though each
  worker has one core and no spare one for the engine; the default, auto, does not pin then);
- ``MWMS``: tf.distribute.MultiWorkerMirroredStrategy with tf-keras (Keras 3's fails inside
  model.fit, keras-team/keras#20585), 2 worker processes over gRPC on localhost;
- ``Horovod``: where ``horovod.tensorflow.keras`` imports (it does not build against TF 2.21).

Scaling efficiency = 2-worker images/s / (2 x 1-worker images/s). Step times are medians over
the timed steps (after warm-up steps that trace and build).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from fastxfer.bench._common import machine_info, print_markdown, print_table, print_targets, status, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--batch", type=int, default=16, help="per-worker batch (default 16)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--model", default="ResNet50", help="a keras.applications model name (default ResNet50)")
    p.add_argument("--no-peers", action="store_true", help="skip MultiWorkerMirroredStrategy and Horovod")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------
# workers (run as `python -m fastxfer.bench.train --worker KIND`)

def _threads_one(inter_op: int | None = 1) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    if inter_op is not None:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def _data(args, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    n = args.batch * (args.steps + args.warmup)
    x = rng.random((n, args.image_size, args.image_size, 3), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    return x, y


def _timed_fit(keras_mod, model, x, y, args):
    """Fits warm-up steps, then the timed steps; returns per-step seconds."""
    times = []

    class Clock(keras_mod.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    w = args.warmup * args.batch
    model.fit(x[:w], y[:w], batch_size=args.batch, epochs=1, verbose=0, shuffle=False)
    model.fit(x[w:], y[w:], batch_size=args.batch, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    return times


def _worker_fastxfer(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import fastxfer.keras as hvd

    hvd.init()
    kind = args.worker.split(":", 1)[1]  # alone, alone-interop, nocomm, none, bf16, fp16, bf16-pin
    if kind.endswith("-pin"):
        kind = kind[:-len("-pin")]  # FASTXFER_TF_PIN=1 came in the environment
    _threads_one(None if kind == "alone-interop" else 1)
    import keras

    model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.image_size,) * 2 + (3,),
                                                     classes=10)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    if kind not in ("alone", "alone-interop", "nocomm"):
        opt = hvd.DistributedOptimizer(opt, compression=kind)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    x, y = _data(args, hvd.rank())
    if kind not in ("alone", "alone-interop", "nocomm"):
        hvd.broadcast_variables(model.variables, root_rank=0)
    times = _timed_fit(keras, model, x, y, args)
    print("RESULT " + json.dumps({"rank": hvd.rank(), "times": times}), flush=True)
    hvd.shutdown()


def _worker_mwms(args) -> None:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.sched_setaffinity(0, {args.rank % len(os.sched_getaffinity(0))} if len(os.sched_getaffinity(0)) > 1
                         else os.sched_getaffinity(0))
    import tensorflow as tf

    _threads_one()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = getattr(tf.keras.applications, args.model)(weights=None,
                                                           input_shape=(args.image_size,) * 2 + (3,), classes=10)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    x, y = _data(args, args.rank)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

    def ds(a, b):  # global batch = 2 x per-worker batch, each worker gets its half
        return tf.data.Dataset.from_tensor_slices((a, b)).batch(args.batch * 2).with_options(opts)

    times = []

    class Clock(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    import numpy as np

    x2, y2 = np.concatenate([x, x]), np.concatenate([y, y])
    w = args.warmup * args.batch * 2
    model.fit(ds(x2[:w], y2[:w]), epochs=1, verbose=0)
    model.fit(ds(x2[w:], y2[w:]), epochs=1, verbose=0, callbacks=[Clock()])
    print("RESULT " + json.dumps({"rank": args.rank, "times": times}), flush=True)


def _worker_horovod(args) -> None:  # pragma: no cover - Horovod does not build against TF 2.21
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import horovod.tensorflow.keras as hvd

    hvd.init()
    _threads_one()
    import tensorflow as tf

    model = getattr(tf.keras.applications, args.model)(weights=None, input_shape=(args.image_size,) * 2 + (3,),
                                                       classes=10)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    x, y = _data(args, hvd.rank())
    times = _timed_fit(tf.keras, model, x, y, args)
    print("RESULT " + json.dumps({"rank": hvd.rank(), "times": times}), flush=True)


# ---------------------------------------------------------------------------------------------
# driver

def _worker_args(args) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--image-size", str(args.image_size), "--model", args.model]


def _parse(stdout: str) -> list[list[float]]:
    out = []
    for line in stdout.splitlines():
        i = line.find("RESULT ")
        if i >= 0:
            out.append(json.loads(line[i + 7:])["times"])
    return out


def _run_fastxfer(args, kind: str, np_: int) -> list[list[float]]:
    cmd = [sys.executable, "-m", "fastxfer.cli", "run", "-np", str(np_), "--bind", "socket", "--",
           sys.executable, "-m", "fastxfer.bench.train", "--worker", f"fastxfer:{kind}"] + _worker_args(args)
    env = dict(os.environ, **({"FASTXFER_TF_PIN": "1"} if kind.endswith("-pin") else {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir(), env=env)
    res = _parse(r.stdout)
    if r.returncode != 0 or len(res) != np_:
        raise RuntimeError(f"fastxfer {kind} run failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_mwms(args) -> list[list[float]]:
    ports = [_free_port(), _free_port()]
    procs = []
    for rank in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                                      "task": {"type": "worker", "index": rank}}))
        cmd = [sys.executable, "-m", "fastxfer.bench.train", "--worker", "mwms", "--rank", str(rank)] + _worker_args(args)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=tempfile.gettempdir()))
    outs = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=3600)
            outs.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = [t for _, o, _ in outs for t in _parse(o)]
    if any(rc != 0 for rc, _, _ in outs) or len(res) != 2:
        raise RuntimeError("MultiWorkerMirroredStrategy run failed:\n" + "\n".join(e[-2000:] for _, _, e in outs))
    return res


def _run_horovod(args) -> list[list[float]]:  # pragma: no cover
    cmd = ["horovodrun", "-np", "2", sys.executable, "-m", "fastxfer.bench.train", "--worker", "horovod"] + \
        _worker_args(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    res = _parse(r.stdout)
    if r.returncode != 0 or len(res) != 2:
        raise RuntimeError(f"Horovod run failed:\n{r.stderr[-2000:]}")
    return res


def _step_ms(per_rank: list[list[float]]) -> float:
    # a synchronous step ends when the slowest rank's does: the median of the per-step maximum
    steps = min(len(t) for t in per_rank)
    return statistics.median(max(t[i] for t in per_rank) for i in range(steps)) * 1e3


def main(args: argparse.Namespace) -> int:
    if args.worker:
        if args.worker.startswith("fastxfer:"):
            _worker_fastxfer(args)
        elif args.worker == "mwms":
            _worker_mwms(args)
        else:
            _worker_horovod(args)
        return 0
    machine = machine_info()
    rows = []  # (name, workers, ms/step)
    plan = [("alone (1 worker)", lambda: _run_fastxfer(args, "alone", 1), 1),
            ("alone, default inter-op threads", lambda: _run_fastxfer(args, "alone-interop", 1), 1),
            ("no-comm (2 independent workers)", lambda: _run_fastxfer(args, "nocomm", 2), 2),
            ("fastxfer none", lambda: _run_fastxfer(args, "none", 2), 2),
            ("fastxfer bf16", lambda: _run_fastxfer(args, "bf16", 2), 2),
            ("fastxfer bf16, submits pinned", lambda: _run_fastxfer(args, "bf16-pin", 2), 2)]
    if not args.no_peers:
        if importlib.util.find_spec("tf_keras") is not None:
            plan.append(("MWMS (tf-keras)", lambda: _run_mwms(args), 2))
        else:
            status("MultiWorkerMirroredStrategy skipped: tf-keras is not installed (pip install tf-keras)")
        if importlib.util.find_spec("horovod") is not None:
            plan.append(("Horovod", lambda: _run_horovod(args), 2))
        else:
            status("Horovod skipped: not installed (Horovod 0.28.1 does not build against TF 2.21)")
    for name, fn, n in plan:
        status(f"{name}: {args.steps} steps of batch {args.batch} x {n} ...")
        try:
            ms = _step_ms(fn())
        except RuntimeError as e:
            status(f"{name} failed: {str(e).splitlines()[0]}")
            if name.startswith(("alone (", "fastxfer")):
                raise
            continue
        rows.append((name, n, ms))
        status(f"{name}: {ms:.1f} ms/step")
    alone = rows[0][2]
    table, results = [], []
    by = {name: (n, ms) for name, n, ms in rows}
    mwms = by.get("MWMS (tf-keras)")
    for name, n, ms in rows:
        ips = n * args.batch / ms * 1e3
        eff = alone / ms  # (n*B/ms) / (n * B/alone)
        vs_mwms = (mwms[1] / ms) if mwms and n == 2 else None
        table.append([name, str(n), f"{ms:.1f}", f"{ips:.1f}", f"{eff * 100:.0f}%",
                      f"{vs_mwms:.2f}x" if vs_mwms else "-"])
        results.append({"name": name, "workers": n, "ms_per_step": ms, "images_per_s": ips, "efficiency": eff,
                        "vs_mwms": vs_mwms})
    cols = ["run", "workers", "ms/step", "images/s", "scaling eff.", "throughput vs MWMS"]
    caption = (f"{machine['cpu']}, {machine['cpus']} CPUs, {machine['date']}; {args.model} {args.image_size}x"
               f"{args.image_size}, batch {args.batch}/worker, 1 intra-op thread/worker, median of {args.steps} steps")
    print_table("Keras training throughput, 1 vs 2 workers", cols, table, caption)
    bf16 = by.get("fastxfer bf16")
    nocomm = by.get("no-comm (2 independent workers)")
    targets, notes = [], []
    if bf16:
        eff = alone / bf16[1]
        targets.append({"target": "scaling efficiency with bf16", "value": eff, "need": 0.75, "ok": eff >= 0.75})
        hv = by.get("Horovod")
        if hv:
            targets.append({"target": "throughput vs Horovod (2 workers)", "value": hv[1] / bf16[1], "need": 2.0,
                            "ok": hv[1] / bf16[1] >= 2})
        else:
            notes.append("Horovod not measured (not installed): no ratio against it")
        if nocomm:
            notes.append(f"ceiling here: 2 workers without any communication reach {alone / nocomm[1] * 100:.0f}% "
                         f"scaling efficiency; fastxfer bf16 adds {bf16[1] - nocomm[1]:.1f} ms/step over them")
        wide = by.get("alone, default inter-op threads")
        if wide:
            notes.append(f"one worker with TensorFlow's default inter-op threads (both cores) runs {wide[1]:.1f} "
                         f"ms/step; against it, fastxfer bf16's efficiency is {wide[1] / bf16[1] * 100:.0f}%")
        if mwms:
            notes.append(f"fastxfer bf16 throughput = {mwms[1] / bf16[1]:.2f}x MultiWorkerMirroredStrategy's")
    print_targets(targets)
    for n in notes:
        print(f"  note: {n}")
    print_markdown(machine, caption, cols, table, targets)
    if args.json:
        write_json(args.json, {"machine": machine, "results": results, "targets": targets, "notes": notes})
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
