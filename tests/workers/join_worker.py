"""Worker for tests/multiproc/test_join.py: ranks with uneven numbers of batches call join().
Prints one JSON line per rank with every result, which the test checks against values it computes."""

import json
import sys

import numpy as np

import fastxfer as fx

STEPS = {2: [2, 4], 3: [3, 5, 1], 4: [3, 5, 1, 2]}


def uneven():
    fx.init()
    r, n = fx.rank(), fx.size()
    out = []
    for i in range(STEPS[n][r]):
        x = np.full(5, float(r + 1), np.float32)
        out.append({
            "sum": fx.allreduce(x, op="sum", name=f"g{i}").tolist(),
            "max_i64": fx.allreduce(np.array([r + 1, -r], np.int64), op="max", name=f"m{i}").tolist(),
            "min_f64": fx.allreduce(np.array([r + 1.0], np.float64), op="min", name=f"mn{i}").tolist(),
            "avg_bf16": fx.allreduce(x, op="average", compression="bf16", name=f"a{i}").tolist(),
        })
    last = fx.join()
    after = fx.allreduce(np.ones(2, np.float32), op="sum", name="after").tolist()
    print("RESULT " + json.dumps({"rank": r, "last": last, "steps": out, "after": after}), flush=True)


def broadcast_while_joined():
    """Rank 0 joins; rank 1's broadcast fails alone (as in Horovod, only allreduces run while a rank
    has joined), then rank 1 joins too, the join completes, and the job goes on."""
    fx.init()
    r = fx.rank()
    if r == 0:
        last = fx.join()
    else:
        try:
            fx.broadcast(np.ones(3, np.float32), root=1, name="late")
            print(f"NO ERROR rank {r}")
        except fx.MismatchError as e:
            print(f"MISMATCH rank {r}: {e}")
        last = fx.join()
    after = fx.allreduce(np.full(2, r + 1.0, np.float32), op="sum", name="after").tolist()
    print(f"JOINED rank {r} last={last} after={after}", flush=True)


if __name__ == "__main__":
    {"uneven": uneven, "broadcast_while_joined": broadcast_while_joined}[sys.argv[1]]()
    fx.shutdown()
