"""Elastic faults of issue 34 row 13 (tests/multiproc/test_elastic.py). usage: elastic_stop_worker.py MODE
- stop_before_init: worker 2 stops itself (SIGSTOP) before its first init();
- stop_in_training: worker 2 stops itself at step 3;
- restart_dies: worker 2 is killed at step 3, and its replacement (worker 3) dies before it joins.
Prints "DONE steps S size N" on every worker that finishes."""

import os
import signal
import sys
import time

import numpy as np

import fastxfer as fx
import fastxfer.elastic as elastic

WORKER = int(os.environ.get("FASTXFER_WORKER_ID", "-1"))
MODE = sys.argv[1]
if MODE == "stop_before_init" and WORKER == 2:
    os.kill(os.getpid(), signal.SIGSTOP)
if MODE == "restart_dies" and WORKER == 3:
    sys.exit(3)  # the replacement dies before it joins
fx.init()


@elastic.run
def train(state):
    while state.step < 10:
        if WORKER == 2 and state.step == 3:
            os.kill(os.getpid(), signal.SIGSTOP if MODE == "stop_in_training" else signal.SIGKILL)
        got = fx.allreduce(np.ones(2, np.float32), op="sum")
        assert got[0] == fx.size()
        state.step += 1
        state.commit()
        time.sleep(0.1)
        if MODE == "restart_dies" and fx.size() < 3 and state.step >= 6:
            # Wait for worker 4 (it imports and starts on a loaded machine) before the last steps,
            # so the job cannot finish at size 2 first; check_host_updates raises once it waits.
            # A count, not a clock, so every rank makes the same number of collective calls.
            for _ in range(600):
                state.check_host_updates()
                time.sleep(0.2)
    return state.step


steps = train(elastic.ObjectState(step=0))
print(f"DONE steps {steps} size {fx.size()}", flush=True)
