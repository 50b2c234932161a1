"""One rank of ``fastxfer bench placement``: repeats a training-like step (a chain of float32
matmuls as forward and backward, gradients handed to the engine as they are produced) and writes
rank 0's median step time and CPU affinity to ``OUT.0``.

Started under ``fastxfer run -np 2 [--bind ...]`` as
``python -m fastxfer.bench.workers.placement_worker --steps 30 --dim 512 --grads 8 --grad-mb 2 --out PATH``;
``--pin-engine`` pins rank r's engine thread to the r-th CPU this process may use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import fastxfer as fx
from fastxfer import settings
from fastxfer.bench.harness import write_result

WARMUP_STEPS = 3


def run(steps: int, dim: int, grads: int, grad_mb: float, out: str) -> None:
    fx.init()
    rng = np.random.default_rng(fx.rank())
    w = [rng.standard_normal((dim, dim)).astype(np.float32) for _ in range(4)]
    x = rng.standard_normal((dim, dim)).astype(np.float32)
    g = [rng.standard_normal(int(grad_mb * 2**20 / 4)).astype(np.float32) for _ in range(grads)]
    times = []
    for step in range(steps + WARMUP_STEPS):
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
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    if fx.rank() == 0:
        write_result(out, 0, {"median": statistics.median(times), "steps": len(times),
                              "affinity": sorted(os.sched_getaffinity(0))})
    fx.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.workers.placement_worker", description=__doc__)
    ap.add_argument("--steps", type=int, required=True, help="timed steps (after 3 untimed ones)")
    ap.add_argument("--dim", type=int, required=True, help="matmul size of the stand-in layers")
    ap.add_argument("--grads", type=int, required=True, help="gradient tensors per step")
    ap.add_argument("--grad-mb", type=float, required=True, help="size of each gradient tensor")
    ap.add_argument("--pin-engine", action="store_true",
                    help="pin rank r's engine thread to the r-th allowed CPU (through FASTXFER_ENGINE_CPUS)")
    ap.add_argument("--out", required=True, help="rank 0's result goes to OUT.0")
    a = ap.parse_args(argv)
    if a.pin_engine:
        # read by fx.init(), so setting it here, before init, is the same as setting it at launch
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["FASTXFER_ENGINE_CPUS"] = str(cpus[settings.get("FASTXFER_RANK") % len(cpus)])
    run(a.steps, a.dim, a.grads, a.grad_mb, a.out)


if __name__ == "__main__":
    main()
