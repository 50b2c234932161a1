"""Elastic: worker 2 joins the first generation and dies (SIGKILL) before it attaches to the shared
memory (tests/multiproc/test_elastic.py, issue 34 row 3). The others notice at once (by the pid the
launcher gave them), join the next generation and train. usage: elastic_attach_worker.py FLAG_FILE
(the victim dies only the first time: a restarted worker 2 would run normally)."""

import os
import signal
import sys
import time

import numpy as np

import fastxfer as fx
import fastxfer.elastic as elastic
from fastxfer.comm import rendezvous

WORKER = int(os.environ.get("FASTXFER_WORKER_ID", "-1"))
if WORKER == 2 and not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    rendezvous.join()  # a member of generation 0 ...
    os.kill(os.getpid(), signal.SIGKILL)  # ... that never attaches
t0 = time.monotonic()
fx.init()
print(f"init took {time.monotonic() - t0:.1f} s, size {fx.size()}", flush=True)


@elastic.run
def train(state):
    while state.step < 3:
        got = fx.allreduce(np.ones(2, np.float32), op="sum")
        assert got[0] == fx.size()
        state.step += 1
        state.commit()
    return state.step


print(f"DONE rank {fx.rank()} size {fx.size()} steps {train(elastic.ObjectState(step=0))}", flush=True)
