"""``fastxfer bench placement``: the effect of binding on a 2-worker data-parallel step, here.

Each worker repeats a training-like step: a chain of float32 matmuls standing in for forward and
backward (one BLAS thread), with the gradients handed to the engine as they are produced
(allreduce_async, overlapping the rest of the compute) and waited for at the end of the step.
Configurations, side by side in one run: unbound (the OS schedules freely); unbound workers
but each engine thread pinned to one CPU (rank r's to the r-th allowed CPU); and `--bind numa`
(workers, and so their engine threads, bound to their own cores, memory to their node).
Reports the median step time and the ratio to unbound.
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

import numpy as np

from fastxfer.bench._common import machine_info, print_markdown, print_table, status


def _worker(steps: int, dim: int, grads: int, grad_mb: float, out: str) -> None:
    import fastxfer as fx

    fx.init()
    rng = np.random.default_rng(fx.rank())
    w = [rng.standard_normal((dim, dim)).astype(np.float32) for _ in range(4)]
    x = rng.standard_normal((dim, dim)).astype(np.float32)
    g = [rng.standard_normal(int(grad_mb * 2**20 / 4)).astype(np.float32) for _ in range(grads)]
    times = []
    for step in range(steps + 3):
        fx.barrier()
        t0 = time.perf_counter()
        h = x
        for m in w:  # forward
            h = np.tanh(h @ m)
        handles = []
        for i, m in enumerate(reversed(w)):  # backward: a gradient is ready after each layer
            h = h @ m.T
            for k in range(i * grads // len(w), (i + 1) * grads // len(w)):
                handles.append(fx.allreduce_async(g[k], compression="bf16", name=f"g{k}"))
        for hd in handles:
            hd.wait()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    if fx.rank() == 0:
        with open(out, "w") as f:
            json.dump({"median": statistics.median(times), "steps": len(times),
                       "affinity": sorted(os.sched_getaffinity(0))}, f)
    fx.shutdown()


CONFIGS = [
    ("unbound", [], {}),
    ("unbound, engine threads pinned", [], {"pin": "1"}),
    ("--bind numa", ["--bind", "numa"], {}),
]


def run(steps: int, dim: int, grads: int, grad_mb: float) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastxfer-place-") as tmp:
        for label, launcher, extra in CONFIGS:
            status(f"{label}: 2 workers x {steps} steps")
            out = os.path.join(tmp, "r.json")
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
            worker = [sys.executable, "-m", "fastxfer.bench.placement", "--worker", "--steps", str(steps), "--dim",
                      str(dim), "--grads", str(grads), "--grad-mb", str(grad_mb), "--out", out]
            if extra.get("pin"):
                # rank r's engine thread on the r-th allowed CPU, through FASTXFER_ENGINE_CPUS
                worker = [sys.executable, "-c", "import os, sys; cpus = sorted(os.sched_getaffinity(0)); "
                          "os.environ['FASTXFER_ENGINE_CPUS'] = str(cpus[int(os.environ['FASTXFER_RANK']) % len(cpus)]);"
                          " os.execv(sys.argv[1], sys.argv[1:])"] + worker
            r = subprocess.run([sys.executable, "-m", "fastxfer.cli", "run", "-np", "2", *launcher, "--", *worker],
                               env=env, capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise SystemExit(f"{label} failed: {r.stderr.strip()[-500:]}")
            with open(out) as f:
                res = json.load(f)
            rows.append({"config": label, "step_ms": res["median"] * 1e3, "steps": res["steps"],
                         "rank0_cpus": res["affinity"]})
    base = rows[0]["step_ms"]
    for r in rows:
        r["speedup"] = base / r["step_ms"]
    return {"machine": machine_info(), "dim": dim, "grads": grads, "grad_mb": grad_mb, "rows": rows}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dim", type=int, default=512, help="matmul size of the stand-in layers")
    p.add_argument("--grads", type=int, default=8, help="gradient tensors per step")
    p.add_argument("--grad-mb", type=float, default=2.0, help="size of each gradient tensor")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", action="store_true")


def main(args: argparse.Namespace) -> int:
    res = run(args.steps, args.dim, args.grads, args.grad_mb)
    cols = ["configuration", "median step ms", "speed-up vs unbound", "rank 0 CPUs"]
    rows = [[r["config"], f"{r['step_ms']:.1f}", f"{r['speedup']:.2f}x", str(r["rank0_cpus"])] for r in res["rows"]]
    m = res["machine"]
    caption = (f"{m['date']} | {m['cpu']} | {m['cpus']} CPUs | 2 workers, 4 matmuls of {res['dim']}^2 fwd+bwd, "
               f"{res['grads']} x {res['grad_mb']} MB gradients (bf16) per step")
    print_table("fastxfer bench placement", cols, rows, caption)
    if args.markdown:
        print_markdown(m, caption, cols, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.placement", description=__doc__)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    add_arguments(ap)
    a = ap.parse_args()
    if a.worker:
        _worker(a.steps, a.dim, a.grads, a.grad_mb, a.out)
    else:
        sys.exit(main(a))
