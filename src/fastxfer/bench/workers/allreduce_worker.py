"""One rank of ``fastxfer bench allreduce``: sweeps the message sizes with one implementation
(fastxfer, torch gloo, mpi4py, Horovod or DeepSpeed's shared-memory allreduce) and writes its
timings and #wrong to ``OUT.<rank>`` (or ``{"skip": reason}`` when the peer cannot run here; ``row_skips``
names the rows it left out while running the others).

Started by the driver under ``fastxfer run`` (mpirun for mpi4py), e.g.
``python -m fastxfer.bench.workers.allreduce_worker --impl fastxfer --sizes 1024,4096 --out /tmp/r``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np

from fastxfer import settings
from fastxfer.bench.harness import write_result

IMPLS = ("fastxfer", "gloo", "mpi4py", "horovod", "deepspeed")
F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
# DeepSpeed names its shared-memory segments <prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> and
# never unlinks them (deepspeed/ops/csrc/cpu/comm/shm.cpp); the driver removes what is left.
DEEPSPEED_SHM_PREFIX = "deepspeed_allreduce_buffer"
DEEPSPEED_ADDR = "127.0.0.1"


def deepspeed_segments(port: int | str, ranks: int) -> list[str]:
    """The /dev/shm paths DeepSpeed's allreduce creates for a job on `port` with `ranks` ranks."""
    return [f"/dev/shm/{DEEPSPEED_SHM_PREFIX}_{os.getuid()}_{DEEPSPEED_ADDR}_{port}_{r}" for r in range(ranks)]


def iterations(nbytes: int, scale: float) -> int:
    # a median of microseconds needs hundreds of calls (they cost a millisecond or two in all)
    base = 400 if nbytes <= 1 << 16 else 60 if nbytes <= 1 << 20 else 25 if nbytes <= 1 << 22 else 15
    return max(3, int(base * scale))


WARMUP_CALLS = 1000  # every implementation's first timed call comes after this many


def warm_up(barrier, op, rank: int) -> None:
    """WARMUP_CALLS calls of ``op`` on a 4 KiB array, each after a barrier, on every rank (a fixed
    count: a collective that each rank repeated by its own clock would not line up). The first
    label of a job otherwise pays for the job's start (lazy imports, first page faults, peers
    still settling) in its smallest sizes: 14 us against the next label's 7 at 4 KiB."""
    x = pattern(rank, 1024)
    out = np.empty_like(x)
    for _ in range(WARMUP_CALLS):
        barrier()
        op(x, out)


def pattern(rank: int, n: int, dtype=F32) -> np.ndarray:
    """Small integers, so that every float32 (and bf16/fp16) sum is exact and the result is known."""
    return ((np.arange(n) % 13) + rank).astype(dtype)


def expected(size: int, n: int, dtype=F32) -> np.ndarray:
    return (size * (np.arange(n) % 13) + size * (size - 1) / 2).astype(dtype)


def expected_adasum(size: int, n: int) -> np.ndarray:
    """Adasum of every rank's `pattern` (float64, Horovod's pairwise rule over a binary tree in rank
    order; ranks past the largest power of two folded in first), rounded to float32."""
    vs = [pattern(j, n, np.float64) for j in range(size)]

    def pair(a, b):
        dot, an, bn = a @ b, a @ a, b @ b
        return (1.0 - dot / an / 2 if an >= 1e-8 else 1.0) * a + (1.0 - dot / bn / 2 if bn >= 1e-8 else 1.0) * b

    p = 1
    while p * 2 <= size:
        p *= 2
    for k in range(p, size):
        vs[k - p] = pair(vs[k - p], vs[k])
    level = 1
    while level < p:
        for k in range(0, p, 2 * level):
            vs[k] = pair(vs[k], vs[k + level])
        level *= 2
    return vs[0].astype(F32)


# The other collectives (issue 15), on the same inputs: each rank's `pattern(rank, n)` with n a
# multiple of size. What each returns on `rank`:
def want_alltoall(rank, size, n, dtype=F32):
    k = n // size
    return np.concatenate([pattern(j, n, dtype)[rank * k:(rank + 1) * k] for j in range(size)])


def want_reducescatter(rank, size, n, dtype=F32):
    k = n // size
    return expected(size, n, dtype)[rank * k:(rank + 1) * k]


def want_allgather(rank, size, n, dtype=F32):
    return np.concatenate([pattern(j, n, dtype) for j in range(size)])


WANT = {"alltoall": want_alltoall, "reducescatter": want_reducescatter, "allgather": want_allgather}
COLLECTIVES = ("allreduce", "alltoall", "reducescatter", "allgather")


def collective_of(label: str) -> str:
    """The collective a row label measures (rows without one of the names are allreduce)."""
    return next((c for c in WANT if label.endswith(" " + c)), "allreduce")


def host_tx_bytes() -> int:
    """Bytes this process's network namespace has sent on every interface but loopback: on a
    simulated host (fastxfer.bench.simhosts), what the host put on its link."""
    total = 0
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() != "lo":
                total += int(rest.split()[8])
    return total


def time_sweep(rank, size, sizes, scale, barrier, ops, dtypes=None, wire: bool = False) -> list[dict]:
    """ops: {label: op(x, out)}, run on arrays of dtypes.get(label, float32) of each size in bytes.
    A label ending in " alltoall", " reducescatter" or " allgather" measures that collective (the
    input rounded down to a multiple of size elements, checked against WANT); others allreduce.
    op returns the result (or None: the result is in out), and whatever it returns is dropped before
    the next call, as a training loop drops last step's gradients. Each label runs all its iterations
    at a size before the next label starts (as nccl-tests does: interleaving would let one variant's
    buffers evict another's). With `wire`, each row also gets ``wire_bytes``: what this host sent
    on its links per call (host_tx_bytes over a few more calls between two barriers)."""
    results = []
    first = next((op for label, op in ops.items() if collective_of(label) == "allreduce"
                  and np.dtype((dtypes or {}).get(label, F32)) == F32), None)
    if first is not None:
        warm_up(barrier, first, rank)
    for label, op in ops.items():
        dtype = np.dtype((dtypes or {}).get(label, F32))
        coll = collective_of(label)
        for nbytes in sizes:
            n = nbytes // dtype.itemsize
            if coll != "allreduce":
                n = n // size * size
            x = pattern(rank, n, dtype)
            out = np.empty_like(x) if coll == "allreduce" else np.empty_like(WANT[coll](rank, size, n, dtype))
            res = op(x, out)
            got = res if res is not None else out
            if label.endswith(" adasum"):
                # float32 rounding of the float64 reference: off by at most one unit in the last place
                want = expected_adasum(size, n)
                off = np.abs(got.astype(np.float64) - want) > 2 * np.spacing(np.abs(want)) + 1e-30
                wrong = int(np.count_nonzero(off))
            else:
                want = expected(size, n, dtype) if coll == "allreduce" else WANT[coll](rank, size, n, dtype)
                # compared as float64: the same for every dtype, and a bf16 array compares exactly
                wrong = int(np.count_nonzero(got.astype(np.float64) != want.astype(np.float64))) \
                    if got.shape == want.shape else max(got.size, want.size)
            del res, got
            times = []
            for _ in range(iterations(nbytes, scale)):
                barrier()
                t0 = time.perf_counter()
                op(x, out)
                times.append(time.perf_counter() - t0)
            row = {"impl": label, "bytes": n * dtype.itemsize, "dtype": dtype.name, "p50": statistics.median(times),
                   "wrong": wrong, "iters": len(times), "collective": coll}
            if wire:
                calls = 3
                barrier()
                before = host_tx_bytes()
                for _ in range(calls):
                    op(x, out)
                barrier()
                row["wire_bytes"] = (host_tx_bytes() - before) / calls
            results.append(row)
    return results


def run_deepspeed(sizes: list[int], scale: float) -> tuple[int, int, list[dict] | None, str | None, dict]:
    """DeepSpeed's shared-memory allreduce (deepspeed.comm.inference_all_reduce, in place) on float32
    and bfloat16 torch tensors. Returns (rank, size, results, None, row_skips), or (rank, size, None,
    reason, {}) when DeepSpeed would not run its shared-memory kernel here at all (it would silently
    fall back to torch.distributed's gloo allreduce, which is another row). `row_skips` names the
    rows left out and why: on a CPU without AVX-512BW its float32 kernel runs (AVX2) and its
    bf16 one does not, so only the bf16 row goes."""
    rank, size = settings.get("FASTXFER_RANK"), settings.get("FASTXFER_SIZE")
    # Each rank on a core of its own, as DeepSpeed is meant to run: its ranks spin on shared flags,
    # and two spinning ranks time-sliced on one core took 7 ms instead of 0.15 ms for 1 MiB here.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= size:
        os.sched_setaffinity(0, {cpus[rank]})
    # DeepSpeed takes the shared-memory path only when LOCAL_SIZE equals the world size.
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(size), MASTER_ADDR=DEEPSPEED_ADDR,
                      MASTER_PORT=os.environ["BENCH_PORT"], RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    try:
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator
    except Exception as e:  # noqa: BLE001 - report why the peer cannot run
        return rank, size, None, f"import deepspeed failed: {type(e).__name__}: {e}", {}
    if get_accelerator().device_name() != "cpu":
        return (rank, size, None, f"DeepSpeed chose the {get_accelerator().device_name()!r} accelerator, not 'cpu'",
                {})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=True)
    backend = dist.comm.cdb
    level = getattr(backend, "shm_vector_kernel_level", 0)
    if getattr(backend, "shm_comm_op", None) is None or not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        return rank, size, None, ("DeepSpeed's shm extension (ShareMemCommBuilder) did not build or load; "
                                  "inference_all_reduce would be torch gloo"), {}
    # DeepSpeed's own rule (deepspeed/comm/torch.py): its float32 kernel needs vector level 1 (AVX2),
    # its bf16/fp16 ones level 2 (AVX-512BW); below that it quietly calls gloo instead.
    if level < 1:
        return rank, size, None, f"DeepSpeed's shm kernels need AVX2 (vector level {level})", {}
    labels = ["deepspeed fp32", "deepspeed bf16"]
    row_skips = {}
    if level < 2:
        labels.remove("deepspeed bf16")
        row_skips["deepspeed bf16"] = (f"DeepSpeed's bf16 shm kernel needs AVX-512BW (vector level {level} here); "
                                       "its float32 one ran")

    def op(x, out):
        t = torch.from_numpy(x) if x.dtype == F32 else torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        dist.inference_all_reduce(t)  # in place on the input tensor, as DeepSpeed is used
        return x
    # In place: every timed call sums the previous result again, doubling the small integers; the
    # values stay exact (powers of two times the first result) and far from overflow for <= 64 calls.
    results = time_sweep(rank, size, sizes, scale, dist.barrier, {label: op for label in labels},
                         {"deepspeed bf16": BF16})
    dist.barrier()
    dist.destroy_process_group()
    return rank, size, results, None, row_skips


def _supported(ops: dict, collectives, size: int) -> dict:
    """The ops of the wanted collectives that this peer actually runs (a peer that lacks one, as
    some torch backends lack reduce_scatter, loses that row instead of the whole run)."""
    keep = {}
    for label, op in ops.items():
        coll = collective_of(label)
        if coll not in collectives:
            continue
        x = pattern(0, 4 * size)
        o = np.empty_like(x if coll in ("allreduce",) else WANT[coll](0, size, 4 * size))
        try:
            op(x, o)
        except Exception as e:  # noqa: BLE001 - the backend says it does not have this collective
            print(f"skipping {label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        keep[label] = op
    return keep


def run(impl: str, sizes: list[int], scale: float, out: str, collectives=COLLECTIVES, only: tuple[str, ...] = (),
        wire: bool = False) -> None:
    """`only`: the rows (labels) to run, all where empty; `wire`: count each host's link bytes."""
    def keep(ops: dict) -> dict:
        return {k: v for k, v in ops.items() if not only or k in only}

    row_skips: dict[str, str] = {}  # rows a peer left out while running the others, and why

    if impl == "fastxfer":
        import fastxfer as fx

        fx.init()
        rank, size = fx.rank(), fx.size()
        ops = {f"fastxfer {c}": (lambda x, o, c=c: fx.allreduce(x, op="sum", compression=c, out=o))
               for c in ("none", "bf16", "fp16")}
        # a new array per call (the output pool's case); bf16 arrays reduced as they are (no compression)
        ops["fastxfer none fresh"] = lambda x, o: fx.allreduce(x, op="sum")
        ops["fastxfer bf16 array"] = lambda x, o: fx.allreduce(x, op="sum", out=o)
        ops["fastxfer bf16 array fresh"] = lambda x, o: fx.allreduce(x, op="sum")
        # Horovod's op=hvd.Adasum on float32 (collectives/adasum.h), against "fastxfer none"
        ops["fastxfer adasum"] = lambda x, o: fx.allreduce(x, op="adasum", out=o)
        if "alltoall" in collectives:
            ops["fastxfer alltoall"] = lambda x, o: fx.alltoall(x)[0]
        if "reducescatter" in collectives:
            ops["fastxfer reducescatter"] = lambda x, o: fx.reducescatter(x, op="sum")
        if "allgather" in collectives:
            ops["fastxfer allgather"] = lambda x, o: fx.allgather(x)
        if "allreduce" not in collectives:
            ops = {k: v for k, v in ops.items() if collective_of(k) != "allreduce"}
        results = time_sweep(rank, size, sizes, scale, fx.barrier, keep(ops),
                             {"fastxfer bf16 array": BF16, "fastxfer bf16 array fresh": BF16}, wire)
        stats = fx.engine_stats()
        fx.shutdown()
    elif impl == "gloo":
        import torch
        import torch.distributed as dist

        rank, size = settings.get("FASTXFER_RANK"), settings.get("FASTXFER_SIZE")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank,
                                world_size=size)

        def op(x, o):
            t = torch.from_numpy(o)
            np.copyto(o, x)  # gloo reduces in place; copy the input in, as an out-of-place call would
            dist.all_reduce(t)

        def a2a(x, o):
            dist.all_to_all_single(torch.from_numpy(o), torch.from_numpy(x))

        def rs(x, o):
            dist.reduce_scatter_tensor(torch.from_numpy(o), torch.from_numpy(x))

        def ag(x, o):
            dist.all_gather_into_tensor(torch.from_numpy(o), torch.from_numpy(x))
        ops = {"torch gloo": op, "torch gloo alltoall": a2a, "torch gloo reducescatter": rs,
               "torch gloo allgather": ag}
        results = time_sweep(rank, size, sizes, scale, dist.barrier, keep(_supported(ops, collectives, size)),
                             wire=wire)
        dist.destroy_process_group()
        stats = {}
    elif impl == "mpi4py":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        ops = {"mpi4py Allreduce": lambda x, o: comm.Allreduce(x, o, op=MPI.SUM),
               "mpi4py alltoall": lambda x, o: comm.Alltoall(x, o),
               "mpi4py reducescatter": lambda x, o: comm.Reduce_scatter_block(x, o, op=MPI.SUM),
               "mpi4py allgather": lambda x, o: comm.Allgather(x, o)}
        results = time_sweep(rank, size, sizes, scale, comm.Barrier, keep(_supported(ops, collectives, size)),
                             wire=wire)
        stats = {}
    elif impl == "deepspeed":
        rank, size, results, skip, row_skips = run_deepspeed(sizes, scale)
        if skip is not None:
            write_result(out, rank, {"rank": rank, "size": size, "skip": skip})
            return
        stats = {}
    else:  # horovod
        import horovod.numpy as hvd  # pragma: no cover - not installable on TF 2.21

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        results = time_sweep(rank, size, sizes, scale, lambda: hvd.allreduce(np.zeros(1)),
                             {"horovod": lambda x, o: hvd.allreduce(x, op=hvd.Sum)})
        stats = {}
    write_result(out, rank, {"rank": rank, "size": size, "results": results, "stats": stats,
                             **({"row_skips": row_skips} if row_skips else {})})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fastxfer.bench.workers.allreduce_worker", description=__doc__)
    ap.add_argument("--impl", required=True, choices=IMPLS)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--out", required=True, help="results go to OUT.<rank>")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--only", default="", help="comma-separated row labels to run (default all)")
    ap.add_argument("--wire", action="store_true", help="count the bytes each host sends on its links")
    a = ap.parse_args(argv)
    run(a.impl, [int(s) for s in a.sizes.split(",")], a.iters_scale, a.out,
        tuple(c for c in a.collectives.split(",") if c), tuple(o for o in a.only.split(",") if o), a.wire)


if __name__ == "__main__":
    main()
