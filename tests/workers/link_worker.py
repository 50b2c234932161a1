"""Worker for tests/multihost (a link that goes down, or only slows down), started by `fastxfer run
--hosts`: allreduces and allgathers in a loop. Each rank writes what happened to OUT_DIR/rank<r>
(its output cannot reach the launcher once its host's link is down): ``OK <steps>`` after running
for SECONDS, or ``<exception type> <unix time> <message>`` when a collective raised."""

import os
import sys
import time

import numpy as np

import fastxfer as fx

out_dir, seconds = sys.argv[1], float(sys.argv[2])
fx.init()
r, n = fx.rank(), fx.size()
x = np.full(1 << 18, r + 1.0, np.float32)
print("STARTED", r, os.getpid(), flush=True)


def record(text: str) -> None:
    with open(os.path.join(out_dir, f"rank{r}"), "w") as f:
        f.write(text)


end = time.monotonic() + seconds
steps = 0
try:
    # every rank stops after the same step: rank 0's clock decides, through the collective (each rank's own
    # clock once let rank 0 finish while another rank had started one step more)
    while not fx.broadcast(np.array([time.monotonic() >= end], np.int32), root=0, name="stop")[0]:
        y = fx.allreduce(x, op="sum", name="g")
        assert y[0] == n * (n + 1) / 2 and y[-1] == y[0], (y[0], y[-1])
        if steps % 4 == 0:  # rows r+1 from rank r
            g = fx.allgather(np.full((r + 1, 3), r, np.int32), name="ag")
            assert g.shape == (n * (n + 1) // 2, 3) and int(g[-1, 0]) == n - 1, g.shape
        steps += 1
except fx.FastxferError as e:
    record(f"{type(e).__name__} {time.time():.3f} {e}")
    raise
record(f"OK {steps}")
