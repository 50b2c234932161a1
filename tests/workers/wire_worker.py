"""Counts what this rank's host puts on its links per allreduce (simulated hosts: the namespace's
/proc/self/net/dev): an allreduce of argv[1] bytes of float32, uncompressed and then bf16 on the
wire. Every rank checks the exact result too. Prints `WIRE rank=R local=L comp=C bytes=B` per
compression and `OK wire`."""

import sys

import numpy as np

import fastxfer as fx
from fastxfer.bench.workers.allreduce_worker import host_tx_bytes

CALLS = 3

fx.init()
n = int(sys.argv[1]) // 4
x = ((np.arange(n) % 13) + fx.rank()).astype(np.float32)
want = (fx.size() * (np.arange(n) % 13) + fx.size() * (fx.size() - 1) / 2).astype(np.float32)
for comp in ("none", "bf16"):
    out = np.empty_like(x)
    fx.barrier()
    before = host_tx_bytes()
    for _ in range(CALLS):
        fx.allreduce(x, op="sum", compression=comp, out=out)
    fx.barrier()
    sent = (host_tx_bytes() - before) / CALLS
    assert np.array_equal(out, want), f"{comp}: {np.count_nonzero(out != want)} wrong elements"
    print(f"WIRE rank={fx.rank()} local={fx.local_rank()} comp={comp} bytes={sent:.0f}", flush=True)
print(f"OK wire rank={fx.rank()}", flush=True)
fx.shutdown()
