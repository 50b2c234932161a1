"""A framework-free elastic worker (tests/multiproc/test_elastic.py): ObjectState, fastxfer.elastic.run.

usage: elastic_np_worker.py STEPS [VICTIM@STEP ...]

Each step allreduces (sum) a vector holding the step number and adds element 0 to state.total,
so the total says exactly which steps ran with how many ranks. A VICTIM@STEP worker kills itself
(SIGKILL) after that step, before its commit. At the first step after every reset, a handle of an
allreduce submitted in the old group (before the failure) is waited on: it must fail, never
complete with the new group's data. Prints "DONE rank R size S steps N total T".
$NAP: seconds per step; $LATE="W:S": worker W sleeps S seconds before it joins.
"""

import os
import signal
import sys
import time

import numpy as np

import fastxfer as fx
import fastxfer.elastic as elastic
from _checks import expect

STEPS = int(sys.argv[1])
NAP = float(os.environ.get("NAP", "0"))
VICTIMS = {int(w): int(s) for w, _, s in (a.partition("@") for a in sys.argv[2:])}
WORKER = int(os.environ.get("FASTXFER_WORKER_ID", os.environ.get("FASTXFER_RANK", "-1")))  # plain runs: the rank
stale = []  # handles submitted in an old group


@elastic.run
def train(state):
    while stale:
        h = stale.pop()
        try:
            h.wait()
        except fx.FastxferError as e:
            print(f"old handle failed: {type(e).__name__}", flush=True)
        else:
            raise AssertionError("a handle of the old group completed after the reset")
    while state.step < STEPS:
        time.sleep(NAP)  # $NAP: seconds per step, so a restarted worker has time to start
        x = np.full(4, float(state.step), np.float32)
        y = fx.allreduce(x, op="sum", name=f"step{state.step}")
        expect(float(y[0]) == state.step * fx.size(), f"step {state.step}: {y[0]} != {state.step} x {fx.size()}")
        state.total += float(y[0])
        state.step += 1
        if VICTIMS.get(WORKER) == state.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if VICTIMS and state.step == min(VICTIMS.values()):
            # an allreduce that the victim never joins: it fails with the old group
            stale.append(fx.allreduce_async(np.ones(1 << 16, np.float32), name="never-finished"))
        state.commit()


# a restarted worker that comes too late whatever the machine's speed (on a fast one it started in
# about 0.2 s, in time to join)
late_worker, _, late_s = os.environ.get("LATE", "").partition(":")
if late_worker and int(late_worker) == WORKER:
    time.sleep(float(late_s))
state = elastic.ObjectState(step=0, total=0.0)
train(state)
print(f"DONE rank {fx.rank()} size {fx.size()} steps {state.step} total {state.total:g}", flush=True)
