"""A job as any launcher starts it (tests/multiproc/test_launchers.py): the place variables the
launcher gave before init(), then init(), and exact results that only a job of the announced size
with the right rank order gives. Prints `OK launch rank R of N ...` on success.

argv: [mode] where mode is
  check       (default) the collectives above
  timeline    check, plus named allreduces and a mark for the job's timeline, and the engine settings
  rank1-quits rank 1 (by the launcher's variables) exits 0 before init(); the others init() and fail
"""

import json
import os
import sys

import numpy as np

import fastxfer as fx

PLACE = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
         "HOROVOD_CROSS_SIZE")
mode = sys.argv[1] if len(sys.argv) > 1 else "check"
before = {k: os.environ[k] for k in PLACE if k in os.environ}
if mode == "rank1-quits":
    announced = next(os.environ[k] for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if k in os.environ)
    if announced == "1":
        sys.exit(0)
fx.init()
r, n = fx.rank(), fx.size()
got = fx.allreduce(np.full(5, r + 1, np.float32), op="sum", name="sum")
assert np.array_equal(got, np.full(5, n * (n + 1) / 2, np.float32)), got
b = fx.broadcast(np.full(3, r, np.int64), root=n - 1, name="bcast")
assert np.array_equal(b, np.full(3, n - 1, np.int64)), b
order = fx.allgather(np.array([r], np.int64), name="order")
assert order.tolist() == list(range(n)), order
if mode == "timeline":
    for step in range(3):
        fx.allreduce(np.ones(1000, np.float32), name=f"grad{step}")
    before["cap"] = fx.comm.group.settings()["cap"]
line = (f"OK launch rank {r} of {n} source={fx.comm.layout().source!r} local={fx.local_rank()}/{fx.local_size()} "
        f"place={json.dumps(before, sort_keys=True)}\n")
sys.stdout.flush()
os.write(1, line.encode())  # one write: launchers that share one pipe among ranks keep the line whole
fx.shutdown()
