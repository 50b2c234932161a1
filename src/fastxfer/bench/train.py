"""``fastxfer bench train``: Keras ResNet-50 (weights=None, 32x32 inputs, so that a CPU step is
short and the 25.6M-parameter gradient dominates), per-worker batch 16, one intra-op thread per
worker; 1 worker vs 2 workers, side by side in one run:

- ``alone``: one worker, no communication, 1 intra-op and 1 inter-op thread (the reference for
  scaling efficiency: the same thread budget as each of the 2 workers); also shown with
  TensorFlow's default inter-op threads (it then uses both cores);
- ``one process, every core``: what a user would run instead -- one plain TensorFlow process,
  unbound, TensorFlow's default threads -- at the 2 workers' global batch (2 x batch) and at
  the per-worker batch;
- ``no-comm``: 2 workers training independently (each bound to its own core): what the machine
  allows before any communication, i.e. the ceiling of scaling efficiency here;
- ``fastxfer none`` / ``fastxfer bf16``: 2 workers, ``fastxfer.keras.DistributedOptimizer``;
  also bf16 through the ``tf.numpy_function`` bridge (``FASTXFER_TF_NATIVE=0``, what the native
  ops replaced) and bf16 with ``FASTXFER_TF_PIN=1`` (submits pinned into the backward pass even
  though each worker has one core and no spare one for the engine; the default, auto, does not
  pin then);
- ``fixed cost``: a model of ten small tensors (five Dense(16) layers), 2 workers without
  communication against fastxfer, in alternating blocks of 25 steps of one job: what a step pays
  for communication when there is almost nothing to send; again with ``FASTXFER_TF_HOLD=0`` (a
  negotiation round per tensor instead of one per bucket), and through the numpy_function bridge;
- ``MWMS``: tf.distribute.MultiWorkerMirroredStrategy with tf-keras (Keras 3's fails inside
  model.fit, keras-team/keras#20585), 2 worker processes over gRPC on localhost;
- ``Horovod``: where ``horovod.tensorflow.keras`` imports (it does not build against TF 2.21).

Scaling efficiency = 2-worker images/s / (2 x 1-worker images/s). Step times are medians over
the timed steps (after warm-up steps that trace and build). ``--timeline PATH`` writes the
fastxfer bf16 run's timeline (FASTXFER_TIMELINE) to PATH.
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
    p.add_argument("--timeline", metavar="PATH", help="write the fastxfer bf16 run's timeline (Chrome trace) here")
    p.add_argument("--fixed-steps", type=int, default=300, help="timed steps of the fixed-cost rows (default 300)")
    p.add_argument("--rows", metavar="KEYS",
                   help="run only these rows, comma-separated (alone, alone-interop, wide, wide-local, nocomm, none, "
                        "bf16, bf16-bridge, bf16-pin, fixed-nocomm, fixed-none, fixed-nohold, fixed-nohold-nocomm, "
                        "fixed-bridge, mwms, horovod); "
                        "'alone' always runs: every ratio is taken against it (default: all)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")


def _worker(args, kind: str, out: str, *extra: str, batch: int | None = None, model: str | None = None,
            steps: int | None = None) -> list[str]:
    """The train_worker command for one run; every run gets its own result files `out.<rank>`."""
    return worker_command("train_worker", "--kind", kind, *extra, "--steps", str(steps or args.steps), "--warmup",
                          str(args.warmup), "--batch", str(batch or args.batch), "--image-size", str(args.image_size),
                          "--model", model or args.model, "--out", out)


def _run_fastxfer(args, tmp: str, kind: str, np_: int, batch: int | None = None, bind: bool = True,
                  model: str | None = None, steps: int | None = None, env_extra: dict | None = None,
                  key: str | None = "times") -> list:
    """Per rank, the worker's step times (`key`), or its whole result (key None)."""
    out = os.path.join(tmp, f"fastxfer-{kind}-{batch}-{model}-{len(os.listdir(tmp))}")
    cmd = launcher_command(np_, *(["--bind", "socket"] if bind else [])) + _worker(
        args, f"fastxfer:{kind}", out, batch=batch, model=model, steps=steps)
    env = dict(os.environ, **({"FASTXFER_TF_PIN": "1"} if kind.endswith("-pin") else {}), **(env_extra or {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir(), env=env)
    res = [p[key] if key else p for p in read_results(out, np_)]
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
    wide = 2 * args.batch
    timeline = {"FASTXFER_TIMELINE": os.path.abspath(args.timeline)} if args.timeline else {}
    plan = [("alone", "alone (1 worker)", lambda: _run_fastxfer(args, tmp, "alone", 1), 1),
            ("alone-interop", "alone, default inter-op threads", lambda: _run_fastxfer(args, tmp, "alone-interop", 1), 1),
            ("wide", f"one process, every core, batch {wide}", lambda: _run_fastxfer(args, tmp, "wide", 1, wide, False), 1),
            ("wide-local", f"one process, every core, batch {args.batch}",
             lambda: _run_fastxfer(args, tmp, "wide", 1, None, False), 1),
            ("nocomm", "no-comm (2 independent workers)", lambda: _run_fastxfer(args, tmp, "nocomm", 2), 2),
            ("none", "fastxfer none", lambda: _run_fastxfer(args, tmp, "none", 2), 2),
            ("bf16", "fastxfer bf16", lambda: _run_fastxfer(args, tmp, "bf16", 2, env_extra=timeline), 2),
            ("bf16-bridge", "fastxfer bf16, numpy_function bridge",
             lambda: _run_fastxfer(args, tmp, "bf16", 2, env_extra={"FASTXFER_TF_NATIVE": "0"}), 2),
            ("bf16-pin", "fastxfer bf16, submits pinned", lambda: _run_fastxfer(args, tmp, "bf16-pin", 2), 2)]
    # The fixed cost: no-comm and fastxfer in alternating blocks of one job (train_worker's
    # fixed-ab): separate jobs a minute apart drifted by more than the difference measured.
    ab: dict = {}

    def fixed_ab(side: str, env: dict) -> list[list[float]]:
        k = tuple(sorted(env.items()))
        if k not in ab:
            ab[k] = _run_fastxfer(args, tmp, "fixed-ab", 2, model="tiny", steps=args.fixed_steps, env_extra=env,
                                  key=None)
        return [r["times" if side == "none" else "times_nocomm"] for r in ab[k]]

    fixed = [("fixed-nocomm", "fixed cost: no-comm, 10 small tensors", lambda: fixed_ab("nocomm", {})),
             ("fixed-none", "fixed cost: fastxfer none, 10 small tensors", lambda: fixed_ab("none", {})),
             ("fixed-nohold", "fixed cost: fastxfer none, a round per tensor (FASTXFER_TF_HOLD=0)",
              lambda: fixed_ab("none", {"FASTXFER_TF_HOLD": "0"})),
             ("fixed-nohold-nocomm", "fixed cost: no-comm, beside the FASTXFER_TF_HOLD=0 run",
              lambda: fixed_ab("nocomm", {"FASTXFER_TF_HOLD": "0"})),
             ("fixed-bridge", "fixed cost: fastxfer none, numpy_function bridge (a job of its own)",
              lambda: _run_fastxfer(args, tmp, "none", 2, model="tiny", steps=args.fixed_steps,
                                    env_extra={"FASTXFER_TF_NATIVE": "0"}))]
    for key, name, fn in fixed:
        plan.append((key, name, fn, 2))
    if not args.no_peers:
        if importlib.util.find_spec("tf_keras") is not None:
            plan.append(("mwms", "MWMS (tf-keras)", lambda: _run_mwms(args, tmp), 2))
        else:
            status("MultiWorkerMirroredStrategy skipped: tf-keras is not installed (pip install tf-keras)")
        if importlib.util.find_spec("horovod") is not None:
            plan.append(("horovod", "Horovod", lambda: _run_horovod(args, tmp), 2))
        else:
            status("Horovod skipped: not installed (Horovod 0.28.1 does not build against TF 2.21)")
    if args.rows:
        wanted = [k.strip() for k in args.rows.split(",") if k.strip()]
        known = [key for key, *_ in plan]
        unknown = [k for k in wanted if k not in known]
        if unknown:
            raise SystemExit(f"fastxfer bench train: unknown --rows {', '.join(unknown)}; the rows are "
                             f"{', '.join(known)}")
        # every ratio is taken against one bound worker: that row always runs
        plan = [row for row in plan if row[0] == "alone" or row[0] in wanted]
    plan = [(name, fn, n) for _, name, fn, n in plan]
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
        if name.startswith("fixed cost"):
            continue
        images = wide if name == f"one process, every core, batch {wide}" else n * args.batch
        ips = images / ms * 1e3
        eff = (images / ms) / (n * args.batch / alone)  # against n bound workers at 1 worker's speed
        vs_mwms = (mwms[1] / ms) if mwms and n == 2 else None
        table.append([name, str(n), str(images), f"{ms:.1f}", f"{ips:.1f}", f"{eff * 100:.0f}%",
                      f"{vs_mwms:.2f}x" if vs_mwms else "-"])
        results.append({"name": name, "workers": n, "images_per_step": images, "ms_per_step": ms,
                        "images_per_s": ips, "efficiency": eff, "vs_mwms": vs_mwms})
    cols = ["run", "workers", "images/step", "ms/step", "images/s", "scaling eff.", "throughput vs MWMS"]
    caption = (f"{machine['cpu']}, {machine['cpus']} CPUs, {machine['date']}; {args.model} {args.image_size}x"
               f"{args.image_size}, batch {args.batch}/worker, 1 intra-op thread/worker, median of {args.steps} steps")
    print_table("Keras training throughput, 1 vs 2 workers", cols, table, caption)
    fixed_rows = [[name, f"{ms * 1e3:.0f}"] for name, n, ms in rows if name.startswith("fixed cost")]
    if fixed_rows:
        print_table("Fixed per-step cost (5 x Dense(16): 10 tensors, 2 workers)", ["run", "us/step"], fixed_rows,
                    f"median of {args.fixed_steps} steps")
    bf16 = by.get("fastxfer bf16")
    none = by.get("fastxfer none")
    nocomm = by.get("no-comm (2 independent workers)")
    wide_run = by.get(f"one process, every core, batch {wide}")
    targets, notes = [], []
    if bf16:
        eff = alone / bf16[1]
        targets.append(target("fastxfer bf16: scaling efficiency against one bound worker", eff, 0.88, eff >= 0.88))
        if nocomm:
            r = nocomm[1] / bf16[1]
            targets.append(target("fastxfer bf16: throughput / no-comm ceiling", r, 0.92, r >= 0.92))
        if wide_run:
            r = wide_run[1] / bf16[1]
            targets.append(target(f"fastxfer bf16 (2 x {args.batch}) / one process on every core (batch {wide})",
                                  r, 0.8, r >= 0.8))
            if nocomm:
                notes.append(f"the ceiling against that process: 2 workers without communication reach "
                             f"{wide_run[1] / nocomm[1]:.2f}x its throughput")
        hv = by.get("Horovod")
        if hv:
            targets.append(target("throughput vs Horovod (2 workers)", hv[1] / bf16[1], 2.0, hv[1] / bf16[1] >= 2))
        else:
            notes.append("Horovod not measured (not installed): no ratio against it")
        bridge = by.get("fastxfer bf16, numpy_function bridge")
        if bridge:
            notes.append(f"the native TensorFlow ops save {bridge[1] - bf16[1]:.1f} ms/step over the numpy_function "
                         f"bridge ({bridge[1] / bf16[1]:.2f}x)")
        if nocomm:
            notes.append(f"fastxfer bf16 adds {bf16[1] - nocomm[1]:.1f} ms/step over 2 workers without communication")
        if mwms:
            notes.append(f"fastxfer bf16 throughput = {mwms[1] / bf16[1]:.2f}x MultiWorkerMirroredStrategy's")
    if none and nocomm:
        r = nocomm[1] / none[1]
        targets.append(target("fastxfer none: throughput / no-comm ceiling", r, 0.85, r >= 0.85))
    fx_fixed = by.get("fixed cost: fastxfer none, 10 small tensors")
    nc_fixed = by.get("fixed cost: no-comm, 10 small tensors")
    if fx_fixed and nc_fixed:
        us = (fx_fixed[1] - nc_fixed[1]) * 1e3
        targets.append(target("fixed per-step cost of 10 small tensors (us over no-comm)", us, 300, us <= 300))
    nohold = by.get("fixed cost: fastxfer none, a round per tensor (FASTXFER_TF_HOLD=0)")
    nohold_nc = by.get("fixed cost: no-comm, beside the FASTXFER_TF_HOLD=0 run")
    if nohold and nohold_nc:
        notes.append(f"a negotiation round per tensor (FASTXFER_TF_HOLD=0) costs "
                     f"{(nohold[1] - nohold_nc[1]) * 1e3:.0f} us/step over no-comm")
    if args.timeline:
        notes.append(f"timeline of the fastxfer bf16 run: {args.timeline} (rank 0; other ranks beside it)")
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
