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
import statistics
import subprocess
import sys
import tempfile

from fastxfer.bench.harness import (free_port, launcher_command, machine_info, print_markdown, print_table,
                                    print_targets, read_results, status, target, worker_command, write_json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--batch", type=int, default=16, help="per-worker batch (default 16)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--model", default="ResNet50", help="a keras.applications model name (default ResNet50)")
    p.add_argument("--no-peers", action="store_true", help="skip MultiWorkerMirroredStrategy and Horovod")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")


def _worker(args, kind: str, out: str, *extra: str) -> list[str]:
    """The train_worker command for one run; every run gets its own result files `out.<rank>`."""
    return worker_command("train_worker", "--kind", kind, *extra, "--steps", str(args.steps), "--warmup",
                          str(args.warmup), "--batch", str(args.batch), "--image-size", str(args.image_size),
                          "--model", args.model, "--out", out)


def _run_fastxfer(args, tmp: str, kind: str, np_: int) -> list[list[float]]:
    out = os.path.join(tmp, f"fastxfer-{kind}")
    cmd = launcher_command(np_, "--bind", "socket") + _worker(args, f"fastxfer:{kind}", out)
    env = dict(os.environ, **({"FASTXFER_TF_PIN": "1"} if kind.endswith("-pin") else {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir(), env=env)
    res = [p["times"] for p in read_results(out, np_)]
    if r.returncode != 0 or len(res) != np_:
        raise RuntimeError(f"fastxfer {kind} run failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return res


def _run_mwms(args, tmp: str) -> list[list[float]]:
    out = os.path.join(tmp, "mwms")
    ports = [free_port(), free_port()]
    procs = []
    for rank in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                                      "task": {"type": "worker", "index": rank}}))
        procs.append(subprocess.Popen(_worker(args, "mwms", out, "--rank", str(rank)), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir()))
    outs = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=3600)
            outs.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = [p["times"] for p in read_results(out, 2)]
    if any(rc != 0 for rc, _, _ in outs) or len(res) != 2:
        raise RuntimeError("MultiWorkerMirroredStrategy run failed:\n" + "\n".join(e[-2000:] for _, _, e in outs))
    return res


def _run_horovod(args, tmp: str) -> list[list[float]]:  # pragma: no cover
    out = os.path.join(tmp, "horovod")
    r = subprocess.run(["horovodrun", "-np", "2"] + _worker(args, "horovod", out), capture_output=True, text=True,
                       timeout=3600)
    res = [p["times"] for p in read_results(out, 2)]
    if r.returncode != 0 or len(res) != 2:
        raise RuntimeError(f"Horovod run failed:\n{r.stderr[-2000:]}")
    return res


def _step_ms(per_rank: list[list[float]]) -> float:
    # a synchronous step ends when the slowest rank's does: the median of the per-step maximum
    steps = min(len(t) for t in per_rank)
    return statistics.median(max(t[i] for t in per_rank) for i in range(steps)) * 1e3


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="fastxfer-train-") as tmp:
        return _main(args, tmp)


def _main(args: argparse.Namespace, tmp: str) -> int:
    machine = machine_info()
    rows = []  # (name, workers, ms/step)
    plan = [("alone (1 worker)", lambda: _run_fastxfer(args, tmp, "alone", 1), 1),
            ("alone, default inter-op threads", lambda: _run_fastxfer(args, tmp, "alone-interop", 1), 1),
            ("no-comm (2 independent workers)", lambda: _run_fastxfer(args, tmp, "nocomm", 2), 2),
            ("fastxfer none", lambda: _run_fastxfer(args, tmp, "none", 2), 2),
            ("fastxfer bf16", lambda: _run_fastxfer(args, tmp, "bf16", 2), 2),
            ("fastxfer bf16, submits pinned", lambda: _run_fastxfer(args, tmp, "bf16-pin", 2), 2)]
    if not args.no_peers:
        if importlib.util.find_spec("tf_keras") is not None:
            plan.append(("MWMS (tf-keras)", lambda: _run_mwms(args, tmp), 2))
        else:
            status("MultiWorkerMirroredStrategy skipped: tf-keras is not installed (pip install tf-keras)")
        if importlib.util.find_spec("horovod") is not None:
            plan.append(("Horovod", lambda: _run_horovod(args, tmp), 2))
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
        targets.append(target("scaling efficiency with bf16", eff, 0.75, eff >= 0.75))
        hv = by.get("Horovod")
        if hv:
            targets.append(target("throughput vs Horovod (2 workers)", hv[1] / bf16[1], 2.0, hv[1] / bf16[1] >= 2))
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
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.train", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
