"""One rank of ``fastxfer bench allreduce``: sweeps the message sizes with one implementation
(fastxfer, torch gloo, mpi4py or Horovod) and writes its timings and #wrong to ``OUT.<rank>``.

Started by the driver under ``fastxfer run`` (mpirun for mpi4py), e.g.
``python -m fastxfer.bench.workers.allreduce_worker --impl fastxfer --sizes 1024,4096 --out /tmp/r``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from fastxfer.bench.harness import write_result

IMPLS = ("fastxfer", "gloo", "mpi4py", "horovod")


def iterations(nbytes: int, scale: float) -> int:
    base = 60 if nbytes <= 1 << 16 else 25 if nbytes <= 1 << 22 else 15
    return max(3, int(base * scale))


def pattern(rank: int, n: int) -> np.ndarray:
    """Small integers, so that every float32 (and bf16/fp16) sum is exact and the result is known."""
    return ((np.arange(n) % 13) + rank).astype(np.float32)


def expected(size: int, n: int) -> np.ndarray:
    return (size * (np.arange(n) % 13) + size * (size - 1) / 2).astype(np.float32)


def time_sweep(rank, size, sizes, scale, barrier, ops) -> list[dict]:
    """ops: {label: op(x, out)}. Each label runs all its iterations at a size before the next label
    starts (as nccl-tests does: interleaving would let one variant's buffers evict another's)."""
    results = []
    for label, op in ops.items():
        for nbytes in sizes:
            n = nbytes // 4
            x = pattern(rank, n)
            out = np.empty_like(x)
            res = op(x, out)
            got = res if res is not None else out
            wrong = int(np.count_nonzero(got != expected(size, n)))
            times = []
            for _ in range(iterations(nbytes, scale)):
                barrier()
                t0 = time.perf_counter()
                op(x, out)
                times.append(time.perf_counter() - t0)
            results.append({"impl": label, "bytes": nbytes, "p50": statistics.median(times), "wrong": wrong,
                            "iters": len(times)})
    return results


def run(impl: str, sizes: list[int], scale: float, out: str) -> None:
    if impl == "fastxfer":
        import fastxfer as fx

        fx.init()
        rank, size = fx.rank(), fx.size()
        results = time_sweep(rank, size, sizes, scale, fx.barrier,
                             {f"fastxfer {c}": (lambda x, o, c=c: fx.allreduce(x, op="sum", compression=c, out=o))
                              for c in ("none", "bf16", "fp16")})
        stats = fx.engine_stats()
        fx.shutdown()
    elif impl == "gloo":
        import torch
        import torch.distributed as dist

        rank, size = int(os.environ["FASTXFER_RANK"]), int(os.environ["FASTXFER_SIZE"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank,
                                world_size=size)

        def op(x, o):
            t = torch.from_numpy(o)
            np.copyto(o, x)  # gloo reduces in place; copy the input in, as an out-of-place call would
            dist.all_reduce(t)
        results = time_sweep(rank, size, sizes, scale, dist.barrier, {"torch gloo": op})
        dist.destroy_process_group()
        stats = {}
    elif impl == "mpi4py":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        results = time_sweep(rank, size, sizes, scale, comm.Barrier,
                             {"mpi4py Allreduce": lambda x, o: comm.Allreduce(x, o, op=MPI.SUM)})
        stats = {}
    else:  # horovod
        import horovod.numpy as hvd  # pragma: no cover - not installable on TF 2.21

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        results = time_sweep(rank, size, sizes, scale, lambda: hvd.allreduce(np.zeros(1)),
                             {"horovod": lambda x, o: hvd.allreduce(x, op=hvd.Sum)})
        stats = {}
    write_result(out, rank, {"rank": rank, "size": size, "results": results, "stats": stats})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.workers.allreduce_worker", description=__doc__)
    ap.add_argument("--impl", required=True, choices=IMPLS)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--out", required=True, help="results go to OUT.<rank>")
    a = ap.parse_args(argv)
    run(a.impl, [int(s) for s in a.sizes.split(",")], a.iters_scale, a.out)


if __name__ == "__main__":
    main()
