"""Where a fresh allreduce result comes from, and float32 against 16-bit arrays: the measurements behind
bench/RESULTS.md ("fresh outputs, 16-bit arrays, DeepSpeed peer").
Run on N ranks through the launcher:

    fastxfer run -np 2 -- python bench/allreduce_output_study.py alloc [BYTES]   # where a result array comes from
    fastxfer run -np 2 -- python bench/allreduce_output_study.py dtypes          # float32 vs bf16/fp16 arrays

alloc: a float32 allreduce (default 64 MiB) into a reused ``out=`` and into a fresh array per call
from each candidate source (np.empty_like, mmap with 4 KiB pages, MAP_POPULATE, MADV_HUGEPAGE,
pre-faulted huge pages) and from fastxfer's output pool (``fx.allreduce(x)``). Each row takes 3
calls after a warm-up call, in 5 rounds that cycle through the rows, so the machine's drift hits
all rows alike; rank 0 prints the median per row and its ratio to the reused ``out=``.

dtypes: ``out=`` allreduces of float32 (64 MiB), bf16 (64 and 32 MiB) and fp16 (32 MiB) arrays, the
same rounds, with ns per element and where the engine's time went (fx.engine_stats()).
"""

import mmap
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import fastxfer as fx

HUGE = 2 << 20


def mmap_array(nbytes: int, populate: bool, huge: bool) -> np.ndarray:
    """A fresh float32 array on its own anonymous mapping (unmapped when the array dies)."""
    if not huge:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.float32)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, np.uint8)
    start = (-a.ctypes.data) % HUGE  # only 2 MiB-aligned ranges can become huge pages
    a = a[start:start + nbytes]
    if populate:
        a[::4096] = 0  # fault every page in now (MAP_POPULATE would do it before the madvise)
    return a.view(np.float32)


def rounds(cases: dict, calls: int = 3, n_rounds: int = 5, after=None) -> dict:
    times = {k: [] for k in cases}
    for _ in range(n_rounds):
        for k, f in cases.items():
            f()  # warm-up: the first call of a row may allocate
            for _ in range(calls):
                fx.barrier()
                t0 = time.perf_counter()
                f()  # the result is dropped at once, as a training loop drops last step's
                times[k].append(time.perf_counter() - t0)
            if after:
                after(k)
    return times


def alloc(nbytes: int) -> None:
    r = fx.rank()
    x = np.full(nbytes // 4, 1.0 + r, np.float32)
    out = np.empty_like(x)
    want = float(sum(1.0 + j for j in range(fx.size())))

    def check(y):
        assert float(y[0]) == want and float(y[-1]) == want
        return y

    cases = {
        "reused out= (np.empty)": lambda: check(fx.allreduce(x, op="sum", out=out)),
        "fresh np.empty_like (before this change)": lambda: check(fx.allreduce(x, op="sum", out=np.empty_like(x))),
        "fresh mmap, 4 KiB pages": lambda: check(fx.allreduce(x, op="sum", out=mmap_array(x.nbytes, False, False))),
        "fresh mmap + MAP_POPULATE": lambda: check(fx.allreduce(x, op="sum", out=mmap_array(x.nbytes, True, False))),
        "fresh mmap + MADV_HUGEPAGE": lambda: check(fx.allreduce(x, op="sum", out=mmap_array(x.nbytes, False, True))),
        "fresh mmap + MADV_HUGEPAGE, pre-faulted":
            lambda: check(fx.allreduce(x, op="sum", out=mmap_array(x.nbytes, True, True))),
        "output pool (fx.allreduce(x))": lambda: check(fx.allreduce(x, op="sum")),
    }
    times = rounds(cases)
    if r == 0:
        base = statistics.median(times["reused out= (np.empty)"])
        print(f"{nbytes / 2**20:g} MiB float32, {fx.size()} ranks; median of {len(times[next(iter(times))])} calls")
        print("| result array | ms | busbw GB/s | vs reused out= |\n|---|---|---|---|")
        for k, v in times.items():
            m = statistics.median(v)
            print(f"| {k} | {m * 1e3:.2f} | {nbytes / m / 1e9 * 2 * (fx.size() - 1) / fx.size():.2f} | "
                  f"{base / m:.2f} |")
        print("pool:", fx._core.output_pool_stats())


def dtypes() -> None:
    r = fx.rank()
    mib = 1 << 20
    arrays = {}
    for name, dt, nbytes in (("float32 64 MiB", np.float32, 64 * mib), ("bf16 64 MiB", ml_dtypes.bfloat16, 64 * mib),
                             ("bf16 32 MiB", ml_dtypes.bfloat16, 32 * mib), ("fp16 32 MiB", np.float16, 32 * mib)):
        n = nbytes // np.dtype(dt).itemsize
        x = ((np.arange(n) % 13) + r).astype(dt)
        arrays[name] = (x, np.empty_like(x))
    phases = {k: {} for k in arrays}
    before = {}

    def case(k):
        x, o = arrays[k]

        def f():
            before.setdefault(k, fx.engine_stats())
            fx.allreduce(x, op="sum", out=o)
        return f

    def after(k):  # engine time per call for the round's calls of row k (warm-up included)
        s0, s1 = before.pop(k), fx.engine_stats()
        for p in ("pack_s", "wait_s", "reduce_s", "unpack_s"):
            phases[k].setdefault(p, []).append((s1[p] - s0[p]) / 4)

    times = rounds({k: case(k) for k in arrays}, after=after)
    if r == 0:
        print(f"{fx.size()} ranks, out=, simd {fx.simd_level()}")
        print("| array | ms | ns/element | pack / wait / reduce / unpack ms |\n|---|---|---|---|")
        for k, v in times.items():
            m = statistics.median(v)
            ph = " / ".join(f"{statistics.median(phases[k][p]) * 1e3:.1f}"
                            for p in ("pack_s", "wait_s", "reduce_s", "unpack_s"))
            print(f"| {k} | {m * 1e3:.2f} | {m / arrays[k][0].size * 1e9:.3f} | {ph} |")


if __name__ == "__main__":
    fx.init()
    mode = sys.argv[1] if len(sys.argv) > 1 else "alloc"
    if mode == "alloc":
        alloc(int(sys.argv[2]) if len(sys.argv) > 2 else 64 << 20)
    elif mode == "dtypes":
        dtypes()
    else:
        raise SystemExit(f"unknown mode {mode!r}: alloc or dtypes")
    fx.shutdown()
