"""Worker for tests/faults/test_engine_faults.py, started by `fastxfer run`: one scenario of the
fault audit (issue 14) per invocation. Each prints a line the test parses and exits with a code
that says what happened."""

import gc
import os
import signal
import sys
import time

import numpy as np

import fastxfer as fx

RANK = int(os.environ.get("FASTXFER_RANK", "0"))


def bucket_caps():
    """Ranks whose default bucket caps differ (fx.init(bucket_cap_mb=...) per rank)."""
    fx.init(bucket_cap_mb=1 if RANK == 0 else 2)
    try:
        hs = [fx.allreduce_async(np.full(200_000, i + 1.0, np.float32), op="sum", name=f"g{i}") for i in range(3)]
        got = [h.wait() for h in hs]
        print(f"NO ERROR rank {RANK}: {[float(g[0]) for g in got]}")
    except fx.MismatchError as e:
        print(f"MISMATCH rank {RANK}: {e}")
        sys.exit(3)


def fork():
    """A forked child of an initialised process: a clear error, a normal exit; the parent goes on."""
    fx.init()
    x = np.full(1000, RANK + 1.0, np.float32)
    fx.allreduce(x, op="sum", name="before")
    fx.allreduce(x)  # twice with the defaults: the second call takes the shortcut (collectives._plain_calls)
    fx.allreduce(x)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msgs = []
        for call in (lambda: fx.allreduce(x, op="sum", name="child"), lambda: fx.allreduce(x), fx.barrier, fx.init,
                     lambda: fx.oob_allreduce(x[:4])):
            try:
                call()
                msgs.append("NO ERROR")
            except fx.FastxferError as e:
                msgs.append(f"{type(e).__name__}: {e}")
        os.write(w, ("\n".join(msgs) + f"\nrank-in-child {fx.rank()} of {fx.size()}\n").encode())
        os.close(w)
        sys.exit(0)  # the normal way out: atexit handlers, interpreter teardown
    os.close(w)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            print(f"CHILD HUNG rank {RANK}")
            sys.exit(9)
        time.sleep(0.05)
    with os.fdopen(r) as f:
        for line in f.read().splitlines():
            print(f"CHILD rank {RANK}: {line}")
    print(f"CHILD-EXIT rank {RANK}: {os.waitstatus_to_exitcode(status)}")
    got = fx.allreduce(x, op="sum", name="after")
    print(f"PARENT rank {RANK}: {float(got[0])} {float(got[-1])}")


def dropped_handles():
    """Handles dropped without wait(): the engine forgets them once they finish."""
    fx.init()
    eng = fx.comm.group.engine()
    base = eng.tracked
    for i in range(50):
        fx.allreduce_async(np.ones(1 << 16, np.float32), name=f"ar{i}")  # dropped at once
        # an allgather in flight whose handle nobody keeps (1 MiB result per rank pair)
        fx.comm.collectives.submit(fx.comm.options.gather("allgather", name=f"ag{i}"), np.ones(1 << 17, np.float32))
    fx.barrier()  # every request before it has finished
    gc.collect()
    print(f"TRACKED rank {RANK}: before={base} after={eng.tracked}")


def stall():
    """Rank 1 stops itself (SIGSTOP) while rank 0 waits for it in an allreduce."""
    fx.init()
    fx.barrier()
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        return
    t0 = time.monotonic()
    try:
        fx.allreduce(np.ones(10, np.float32), name="g")
    except fx.PeerFailureError as e:
        print(f"TIMEOUT rank {RANK} after {time.monotonic() - t0:.1f}s: {e}")
        sys.exit(6)


def oob_one_rank():
    """Rank 0 calls oob_allreduce; rank 1 goes on to a barrier."""
    fx.init()
    fx.barrier()
    t0 = time.monotonic()
    try:
        if RANK == 0:
            fx.oob_allreduce(np.ones(3), name="loss")
        else:
            fx.barrier()
        print(f"NO ERROR rank {RANK}")
    except fx.MismatchError as e:
        print(f"MISMATCH rank {RANK} after {time.monotonic() - t0:.1f}s: {e}")
        sys.exit(3)


def scales(value):
    """Every rank passes the same non-finite scale factor, or ranks pass different finite ones."""
    fx.init()
    v = float(value)
    try:
        if np.isfinite(v):
            fx.allreduce(np.ones(4, np.float32), op="sum", postscale=v + (0.1 if RANK == 1 else 0.0), name="s")
        else:
            fx.allreduce(np.ones(4, np.float32), prescale=v, name="s")
        print(f"NO ERROR rank {RANK}")
    except ValueError as e:
        print(f"VALUE-ERROR rank {RANK}: {e}")
        sys.exit(2)
    except fx.MismatchError as e:
        print(f"MISMATCH rank {RANK}: {e}")
        sys.exit(3)


def int_overflow():
    """int32/int64 sums that overflow wrap modulo 2^bits."""
    fx.init()
    for dt in (np.int32, np.int64):
        big = np.iinfo(dt).max
        x = np.array([big, np.iinfo(dt).min, -1, big // 2 + 1], dt)
        got = fx.allreduce(x, op="sum", name=f"i{np.dtype(dt).name}")
        print(f"INT rank {RANK} {np.dtype(dt).name}: {' '.join(str(int(v)) for v in got)}")


if __name__ == "__main__":
    mode = sys.argv[1]
    {"bucket_caps": bucket_caps, "fork": fork, "dropped_handles": dropped_handles, "stall": stall,
     "oob_one_rank": oob_one_rank, "int_overflow": int_overflow}.get(mode, lambda: None)() \
        if mode != "scales" else scales(sys.argv[2])
    fx.shutdown()
