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
import os
import subprocess
import sys
import tempfile

from fastxfer.bench.harness import (launcher_command, machine_info, print_markdown, print_table, read_results, status,
                                    worker_command, write_json)

CONFIGS = [  # (label, launcher options, worker options)
    ("unbound", [], []),
    ("unbound, engine threads pinned", [], ["--pin-engine"]),
    ("--bind numa", ["--bind", "numa"], []),
]


def run(steps: int, dim: int, grads: int, grad_mb: float) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastxfer-place-") as tmp:
        for k, (label, launcher, options) in enumerate(CONFIGS):
            status(f"{label}: 2 workers x {steps} steps")
            out = os.path.join(tmp, f"r{k}")
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
            worker = worker_command("placement_worker", "--steps", str(steps), "--dim", str(dim), "--grads", str(grads),
                                    "--grad-mb", str(grad_mb), *options, "--out", out)
            r = subprocess.run(launcher_command(2, *launcher) + worker, env=env, capture_output=True, text=True,
                               timeout=1800)
            got = read_results(out, 1)
            if r.returncode != 0 or not got:
                raise SystemExit(f"{label} failed: {r.stderr.strip()[-500:]}")
            res = got[0]
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
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.placement", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
