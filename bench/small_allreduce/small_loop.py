"""The 2-rank synchronous allreduce loop behind the alternated-build comparisons in
bench/RESULTS.md (sixteenth session): ``fastxfer run -np 2 python small_loop.py`` with NBYTES
(default 4096) and N (calls per timing, default 4000); rank 0 prints the median of 5 timings.
Point PYTHONPATH at another build (``pip install --target DIR .``) to compare builds. Rank 0 also
prints what its small-bucket tuner measured (FASTXFER_EAGER_TUNE; docs/algorithms.md): per size
class, the rounds and medians of each path and the path it prefers."""
import os
import time

import numpy as np

import fastxfer as fx

fx.init()
n = int(os.environ.get("NBYTES", 4096)) // 4
N = int(os.environ.get("N", 4000))
x = np.ones(n, np.float32)
out = np.empty_like(x)
for _ in range(2000):
    fx.allreduce(x, out=out)
res = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(N):
        fx.allreduce(x, out=out)
    res.append((time.perf_counter() - t) / N * 1e6)
if fx.rank() == 0:
    print(f"size {fx.size()} {n * 4} B: p50 {sorted(res)[2]:.2f} us  all {[round(r, 2) for r in res]}", flush=True)
    for t in fx.engine_stats()["eager_tuning"]:
        print(f"  tuner, up to {t['bytes']} B: {t['eager_rounds']} rounds with the records (median "
              f"{t['eager_median_s'] * 1e6:.2f} us), {t['chunk_rounds']} through the chunks (median "
              f"{t['chunk_median_s'] * 1e6:.2f} us): {t['path']}", flush=True)
fx.shutdown()
