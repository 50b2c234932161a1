"""Elastic: worker 2 finishes early and cleanly (exit 0) at step 3 while the others go on
(tests/multiproc/test_elastic.py, issue 34 row 7). The others' next collective fails with
PeerFailureError (rank 2 finished), the launcher treats it as a departure, and the survivors
re-form and finish. Prints "step S size N" on worker 0 and "DONE rank R steps S"."""

import os
import sys
import time

import numpy as np

import fastxfer as fx
import fastxfer.elastic as elastic

WORKER = int(os.environ.get("FASTXFER_WORKER_ID", "-1"))


@elastic.run
def train(state):
    while state.step < 8:
        if WORKER == 2 and state.step == 3:
            print("worker 2 leaves cleanly", flush=True)
            sys.exit(0)
        got = fx.allreduce(np.ones(2, np.float32), op="sum")
        assert got[0] == fx.size(), (got, fx.size())
        state.step += 1
        state.commit()
        if WORKER == 0:
            print(f"step {state.step} size {fx.size()}", flush=True)
        time.sleep(0.2)
    return state.step


fx.init()
steps = train(elastic.ObjectState(step=0))
print(f"DONE rank {fx.rank()} steps {steps}", flush=True)
