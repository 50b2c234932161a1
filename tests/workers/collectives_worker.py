"""Worker for tests/test_collectives.py, started by `fastxfer run`. One mode per invocation;
every check asserts exact values and the worker prints 'OK <mode> <details>' on success."""

import os
import re
import sys
import time

import ml_dtypes
import numpy as np

import fastxfer as fx

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16, np.dtype(np.int32),
          np.dtype(np.int64)]


def inputs(rank, n, dtype, seed=0):
    """Small integers: every sum, min and max below is exact in every dtype (|sum| <= 4 * 8 < 256)."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(-8, 9, size=n).astype(dtype)


def sweep():
    r, n_ranks = fx.rank(), fx.size()
    sizes = [0, 1, 1001, 300_001]  # the last is larger than the test's window and bucket cap
    checked = 0
    for dtype in DTYPES:
        for op in ("sum", "average", "min", "max"):
            if op == "average" and dtype.kind == "i":
                continue
            for n in sizes:
                xs = [inputs(j, n, dtype, seed=checked) for j in range(n_ranks)]
                stacked = np.stack([x.astype(np.float64) for x in xs])
                want = {"sum": stacked.sum(0), "average": stacked.sum(0), "min": stacked.min(0),
                        "max": stacked.max(0)}[op]
                got = fx.allreduce(xs[r], op=op)
                assert got.dtype == dtype and got.shape == (n,), (got.dtype, got.shape)
                want_t = want.astype(dtype)
                if op == "average":
                    # average = sum * (1/size), multiplied in the dtype (float32 for 16-bit dtypes)
                    calc = np.float64 if dtype == np.float64 else np.float32
                    want_t = (want.astype(calc) * calc(1 / n_ranks)).astype(dtype)
                bad = np.count_nonzero(got.astype(np.float64) != want_t.astype(np.float64))
                assert bad == 0, f"{dtype.name} {op} n={n}: {bad} wrong, e.g. {got[:5]} vs {want_t[:5]}"
                checked += 1
    print(f"OK sweep {checked} cases on rank {r}")


def compressed():
    r, n_ranks = fx.rank(), fx.size()
    rng = np.random.default_rng(7)
    for kind, wire in (("bf16", BF16), ("fp16", np.dtype(np.float16))):
        for n in (1, 1001, 300_001):
            xs = [rng.standard_normal(n).astype(np.float32) for _ in range(n_ranks)]
            for op in ("sum", "average"):
                got = fx.allreduce(xs[r], op=op, compression=kind)
                # The exact contract: every input rounded to the wire format, summed in float32 in
                # rank order, scaled (1/size for average), rounded once more, widened back. Across
                # hosts each host's partial sum is rounded too, then the partials are added
                # (rounding again) and scaled (rounding again).
                def host_sum(members):
                    acc = xs[members[0]].astype(wire).astype(np.float32)
                    for j in members[1:]:
                        acc = acc + xs[j].astype(wire).astype(np.float32)
                    return acc

                k = fx.local_size()
                hosts = [list(range(h * k, (h + 1) * k)) for h in range(n_ranks // k)]
                if len(hosts) == 1:
                    acc = host_sum(hosts[0])
                    if op == "average":
                        acc = acc * np.float32(1 / n_ranks)
                    want = acc.astype(wire).astype(np.float32)
                else:
                    # each host's partial rounded for the wire, the partials added in float32 in
                    # host order and rounded once (MPI's 2-host sum; the piecewise sum for more)
                    parts = [host_sum(h).astype(wire).astype(np.float32) for h in hosts]
                    acc = parts[0].copy()
                    for p in parts[1:]:
                        acc += p
                    acc = acc.astype(wire).astype(np.float32)
                    if op == "average":
                        acc = (acc * np.float32(1 / n_ranks)).astype(wire).astype(np.float32)
                    want = acc
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{kind} {op} n={n}"
                # and the stated tolerance against the exact float64 result
                exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
                if op == "average":
                    exact /= n_ranks
                scale = np.abs(np.stack(xs)).sum(0) / (n_ranks if op == "average" else 1)
                eps = 2.0 ** -8 if kind == "bf16" else 2.0 ** -11
                # the inputs, each host's partial, the sum and the average's scaling round once each:
                # a bound that does not grow with the number of hosts (or ranks)
                bound = 4 * eps * scale + n_ranks * 2.0 ** -23 * scale
                assert np.all(np.abs(got - exact) <= bound + 1e-30), f"{kind} tolerance on {len(hosts)} hosts"
    print(f"OK compressed on rank {r}")


# Two ranks, bf16/fp16 arrays reduced as they are: (rank 0 bits, rank 1 bits, sum, average, min, max).
# Every value is worked out by hand from the contract: decode to float32, combine in rank order (a
# NaN on rank 0 wins over rank 1's; NaN + x is x86's quieted NaN; inf - inf is its default NaN,
# 0xffc00000), scale by 1/2 for the average, round once to nearest-even. bf16 rounds every NaN to
# 0x7fc0 | sign; fp16 keeps the NaN's top payload bits (numpy), so a min/max that only selects keeps
# a signalling NaN as it is.
BITS16 = {
    "bfloat16": [
        (0x3F80, 0x3B80, 0x3F80, 0x3F00, 0x3B80, 0x3F80),  # 1 + 2^-8: a tie, to even (down); average too
        (0x3F81, 0x3B80, 0x3F82, 0x3F02, 0x3B80, 0x3F81),  # odd + half an ulp: a tie, to even (up)
        (0x3F80, 0x3B81, 0x3F81, 0x3F01, 0x3B81, 0x3F80),  # just above the tie: up
        (0x7F80, 0x3F80, 0x7F80, 0x7F80, 0x3F80, 0x7F80),  # inf + 1
        (0x7F80, 0xFF80, 0xFFC0, 0xFFC0, 0xFF80, 0x7F80),  # inf - inf: the default NaN (negative)
        (0x7FC1, 0x3F80, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0),  # NaN on rank 0
        (0x3F80, 0xFF81, 0xFFC0, 0xFFC0, 0xFFC0, 0xFFC0),  # signalling -NaN on rank 1
        (0x7FC1, 0xFF81, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0),  # NaN on both: rank 0's sign
        (0xFF81, 0x7FC1, 0xFFC0, 0xFFC0, 0xFFC0, 0xFFC0),  # ... whichever it is
        (0x7F7F, 0x7F7F, 0x7F80, 0x7F80, 0x7F7F, 0x7F7F),  # max + max overflows float32 itself
        (0x0001, 0x0001, 0x0002, 0x0001, 0x0001, 0x0001),  # smallest subnormals
        (0x0001, 0x8001, 0x0000, 0x0000, 0x8001, 0x0001),  # x - x = +0
        (0x0003, 0x0000, 0x0003, 0x0002, 0x0000, 0x0003),  # 1.5 * 2^-133: a tie, to even (up)
        (0x0001, 0x0000, 0x0001, 0x0000, 0x0000, 0x0001),  # 2^-134: below half, to 0
        (0x007F, 0x0001, 0x0080, 0x0040, 0x0001, 0x007F),  # subnormal + subnormal = smallest normal
        (0x8000, 0x0000, 0x0000, 0x0000, 0x0000, 0x0000),  # -0 + 0 = +0; min/max(-0, +0) is rank 1's +0
        (0x0000, 0x8000, 0x0000, 0x0000, 0x8000, 0x8000),  # ... and rank 1's -0
        (0x8000, 0x8000, 0x8000, 0x8000, 0x8000, 0x8000),  # -0 + -0 = -0
    ],
    "float16": [
        (0x3C00, 0x1000, 0x3C00, 0x3800, 0x1000, 0x3C00),  # 1 + 2^-11: a tie, to even (down)
        (0x3C01, 0x1000, 0x3C02, 0x3802, 0x1000, 0x3C01),  # odd + half an ulp: to even (up)
        (0x3C00, 0x1001, 0x3C01, 0x3801, 0x1001, 0x3C00),  # just above the tie: up
        (0x7C00, 0x3C00, 0x7C00, 0x7C00, 0x3C00, 0x7C00),  # inf + 1
        (0x7C00, 0xFC00, 0xFE00, 0xFE00, 0xFC00, 0x7C00),  # inf - inf: the default NaN (negative)
        (0x7E01, 0x3C00, 0x7E01, 0x7E01, 0x7E01, 0x7E01),  # quiet NaN on rank 0, payload kept
        (0x3C00, 0xFC01, 0xFE01, 0xFE01, 0xFC01, 0xFC01),  # signalling -NaN on rank 1: quieted by the add
        (0x7D00, 0xFE00, 0x7F00, 0x7F00, 0x7D00, 0x7D00),  # NaN on both: rank 0's (quieted by the add)
        (0xFE00, 0x7D00, 0xFE00, 0xFE00, 0xFE00, 0xFE00),  # ... whichever it is
        (0x7BFF, 0x7BFF, 0x7C00, 0x7BFF, 0x7BFF, 0x7BFF),  # 65504 + 65504 overflows; the average does not
        (0x0001, 0x0001, 0x0002, 0x0001, 0x0001, 0x0001),  # smallest subnormals
        (0x0001, 0x8001, 0x0000, 0x0000, 0x8001, 0x0001),  # x - x = +0
        (0x0003, 0x0000, 0x0003, 0x0002, 0x0000, 0x0003),  # 1.5 * 2^-24: a tie, to even (up)
        (0x0001, 0x0000, 0x0001, 0x0000, 0x0000, 0x0001),  # 2^-25: a tie, to even (0)
        (0x03FF, 0x0001, 0x0400, 0x0200, 0x0001, 0x03FF),  # subnormal + subnormal = smallest normal
        (0x8000, 0x0000, 0x0000, 0x0000, 0x0000, 0x0000),  # -0 + 0 = +0
        (0x0000, 0x8000, 0x0000, 0x0000, 0x8000, 0x8000),
        (0x8000, 0x8000, 0x8000, 0x8000, 0x8000, 0x8000),
    ],
}


def bits16():
    """bf16 and fp16 arrays on 2 ranks, every op: the hand-worked cases above at the start, in the
    middle and at the end of both ranks' shards (SIMD bodies and tails), exact to the bit; random
    finite values against numpy; and random bit patterns, whose digest the test compares across SIMD
    levels (the scalar path is the reference)."""
    import hashlib

    r = fx.rank()
    assert fx.size() == 2
    n = 100_003  # several window chunks in the tests' small window; odd, so every tail length shows up
    for name, cases in BITS16.items():
        dtype = BF16 if name == "bfloat16" else np.dtype(np.float16)
        table = np.array(cases, np.uint16)
        k = len(table)
        at = [0, 40_000 + 5, 70_000 + 17, n - k]  # rank 0's and rank 1's shards of both chunks, and the tail
        rng = np.random.default_rng(11)
        vals = [(rng.standard_normal(n) * 100).astype(dtype) for _ in range(2)]
        mine = vals[r].view(np.uint16).copy()
        for p in at:
            mine[p:p + k] = table[:, r]
        for col, op in enumerate(("sum", "average", "min", "max"), start=2):
            got = fx.allreduce(mine.view(dtype), op=op)
            assert got.dtype == dtype and got.shape == (n,)
            g = got.view(np.uint16)
            for p in at:
                bad = [(f"{table[i, 0]:#06x} {table[i, 1]:#06x}: got {g[p + i]:#06x}, want {table[i, col]:#06x}")
                       for i in range(k) if g[p + i] != table[i, col]]
                assert not bad, f"{name} {op} at {p}: {bad}"
            a32, b32 = (v.astype(np.float32) for v in vals)
            want = {"sum": a32 + b32, "average": (a32 + b32) * np.float32(0.5), "min": np.minimum(a32, b32),
                    "max": np.maximum(a32, b32)}[op].astype(dtype).view(np.uint16)
            keep = np.ones(n, bool)
            for p in at:
                keep[p:p + k] = False
            assert np.array_equal(g[keep], want[keep]), f"{name} {op}: {np.count_nonzero(g[keep] != want[keep])} wrong"
            # random bit patterns (NaN payloads, infinities, subnormals everywhere)
            noise = np.random.default_rng(100 + r).integers(0, 1 << 16, n, dtype=np.uint16)
            res = fx.allreduce(noise.view(dtype), op=op)
            print(f"DIGEST {name} {op} {hashlib.sha256(res.view(np.uint16).tobytes()).hexdigest()} rank {r}")
    print(f"OK bits16 {fx.simd_level()} on rank {r}")


def collectives():
    r, n_ranks = fx.rank(), fx.size()
    # broadcast from every root, several dtypes, larger than the window
    for root in range(n_ranks):
        for dtype in (np.float32, np.int64, BF16):
            x = (np.arange(200_003) * (root + 1)).astype(dtype) if r == root else np.zeros(200_003, dtype)
            got = fx.broadcast(x, root=root)
            assert np.array_equal(got, (np.arange(200_003) * (root + 1)).astype(dtype))
    # allgather with a different first dimension per rank (rank j contributes j rows, so rank 0 none)
    for rows_of in (lambda j: j, lambda j: 70_000 + j):
        mine = np.full((rows_of(r), 3), r, np.int32)
        got = fx.allgather(mine)
        want = np.concatenate([np.full((rows_of(j), 3), j, np.int32) for j in range(n_ranks)])
        assert got.shape == want.shape and np.array_equal(got, want), (got.shape, want.shape)
    # async handles complete out of the caller's sight; many small tensors are fused
    hs = [fx.allreduce_async(np.full(37 + i, i + r, np.float32), op="sum", name=f"g{i}") for i in range(200)]
    for i, h in enumerate(hs):
        assert np.all(h.wait() == sum(i + j for j in range(n_ranks)))
    # several buckets in one fused run, each waited for (and released) as soon as it is done,
    # with new requests submitted in between: later buckets must still use the run's own op/scale
    hs = [fx.allreduce_async(np.full(400_000, 2.0 * (r + 1), np.float32), op="average", name=f"multi{i}")
          for i in range(3)]
    for i, h in enumerate(hs):
        got = h.wait()
        assert np.all(got == (n_ranks + 1)), (i, got[:3])
        fx.allreduce_async(np.ones(5, np.int64), op="max", name=f"between{i}").wait()
    # in place
    x = np.full(1000, r + 1.0, np.float32)
    y = fx.allreduce(x, op="sum", out=x)
    assert y is x and np.all(x == n_ranks * (n_ranks + 1) / 2)
    # in place from 4 KiB, where the one-exchange path writes its slot with non-temporal stores and
    # reads this rank's part from the input it is overwriting: every element exact
    for n in (1024, 4099, 8192):
        x = (np.arange(n, dtype=np.float32) % 97) * (r + 1)
        y = fx.allreduce(x, op="sum", out=x)
        want = (np.arange(n, dtype=np.float32) % 97) * np.float32(n_ranks * (n_ranks + 1) / 2)
        assert y is x and np.array_equal(x, want), (n, x[:4], want[:4])
    # a bad out= on the last rank alone is refused there with check.out_like's error, before the call
    # takes an automatic name: the next allreduce of every rank still lines up (same names) and is exact
    if r == n_ranks - 1:
        base = np.zeros(64, np.float32)
        ro = np.zeros(8, np.float32)
        ro.flags.writeable = False
        ones = np.ones(8, np.float32)
        for src, bad, kind, text in (
                (ones, np.zeros(9, np.float32), ValueError, r"out must be float32\[8\], not float32\[9\]"),
                (ones, np.zeros(8, np.float64), ValueError, r"out must be float32\[8\], not float64\[8\]"),
                (ones, np.zeros((2, 4), np.float32), ValueError, r"not float32\[2, 4\]"),
                (ones, ro, ValueError, "C-contiguous and writable"),
                (ones, np.zeros(16, np.float32)[::2], ValueError, "C-contiguous and writable"),
                (ones, [0.0] * 8, TypeError, "out must be a numpy.ndarray, not list"),
                (base[:8], base[4:12], ValueError, "out overlaps the input array without being it")):
            try:
                fx.allreduce(src, out=bad, op="sum")
            except kind as e:
                assert re.search(text, str(e)), (text, str(e))
            else:
                raise AssertionError(f"out={bad!r} was accepted")
    got = fx.allreduce(np.full(8, r + 1.0, np.float32), op="sum")
    assert np.all(got == n_ranks * (n_ranks + 1) / 2), got
    # prescale / postscale
    got = fx.allreduce(np.full(10, 2.0, np.float64), op="sum", prescale=0.5, postscale=3.0)
    assert np.all(got == 3.0 * n_ranks)
    # oob_allreduce while a large allreduce is queued does not wait for it
    big = fx.allreduce_async(np.ones(2_000_000, np.float32), op="sum", name="big")
    m = fx.oob_allreduce(np.array([r, 1.0]), op="sum")
    assert m.tolist() == [sum(range(n_ranks)), n_ranks]
    assert np.all(big.wait() == n_ranks)
    fx.barrier()
    obj = fx.broadcast_object({"epoch": 3, "rank": r}, root=n_ranks - 1)
    assert obj == {"epoch": 3, "rank": n_ranks - 1}
    print(f"OK collectives on rank {r}")


def mismatch(kind):
    r = fx.rank()
    x = np.ones(10, np.float32)
    try:
        if kind == "name":
            fx.allreduce(x, name=f"grad{r}")
        elif kind == "shape":
            fx.allreduce(np.ones(10 + r, np.float32), name="g")
        elif kind == "dtype":
            fx.allreduce(np.ones(10, np.float32 if r == 0 else np.float64), name="g")
        elif kind == "op":
            fx.allreduce(x, op="sum" if r == 0 else "max", name="g")
        elif kind == "order":
            a = fx.allreduce_async(x, name="a" if r == 0 else "b")
            b = fx.allreduce_async(x, name="b" if r == 0 else "a")
            a.wait()
            b.wait()
        elif kind == "count":
            # rank 0 issues one allreduce more than the others, who go on to a barrier
            fx.allreduce(x, name="g")
            if r == 0:
                fx.allreduce(x, name="extra")
            fx.barrier()
        elif kind == "compression":
            fx.allreduce(x, compression="bf16" if r == 0 else "none", name="g")
        elif kind == "oob":
            fx.oob_allreduce(np.ones(2 + r), name="m")
        elif kind == "alltoall_dtype":
            fx.alltoall(np.ones((2, 3), np.float32 if r == 0 else np.int32), name="a")
        elif kind == "alltoall_shape":  # the first dimension may differ, the others may not
            fx.alltoall(np.ones((2, 3 + r), np.float32), name="a")
        elif kind == "reducescatter_shape":
            fx.reducescatter(np.ones((4 + r, 2), np.float32), name="rs")
        elif kind == "reducescatter_op":
            fx.reducescatter(np.ones((4, 2), np.float32), op="sum" if r == 0 else "average", name="rs")
        elif kind == "kind":  # the same name, a different collective
            if r == 0:
                fx.alltoall(np.ones((2, 2), np.float32), name="x")
            else:
                fx.reducescatter(np.ones((2, 2), np.float32), name="x")
        else:
            raise SystemExit(f"unknown mismatch kind {kind}")
    except fx.MismatchError as e:
        print(f"MISMATCH rank {r}: {e}")
        # the collective failed alone, as in Horovod: the next one works (the out-of-band lane's
        # disagreement still poisons the group: docs/algorithms.md)
        n = fx.size()
        try:
            got = fx.allreduce(np.full(4, r + 1.0, np.float32), op="sum", name="after")
            print(f"{'RECOVERED' if got.tolist() == [n * (n + 1) / 2] * 4 else 'WRONG ' + str(got)} rank {r}")
        except fx.MismatchError:
            print(f"STILL-MISMATCH rank {r}")
        sys.exit(3)
    print(f"NO ERROR rank {r}")


def die(victim_kind, n, compression):
    """Rank 1 dies (SIGKILL, or os._exit) from a second thread while every rank, rank 1 included,
    is looping over allreduces of n elements: the death lands in the middle of a collective."""
    import threading

    r = fx.rank()
    x = np.ones(n, np.float32)
    # "compression" may also name another collective to die in: alltoall or reducescatter
    step = {"alltoall": lambda: fx.alltoall(x.reshape(fx.size(), -1) if n % fx.size() == 0 else x[:fx.size()]),
            "reducescatter": lambda: fx.reducescatter(x, op="sum")}.get(compression)
    if step is None:
        step = lambda: fx.allreduce(x, compression=compression)  # noqa: E731
    step()  # warm-up: everyone is attached and working
    if r == 1:
        def victim():
            time.sleep(0.3)
            if victim_kind == "kill":
                os.kill(os.getpid(), 9)
            os._exit(17)

        threading.Thread(target=victim, daemon=True).start()
    t0 = time.monotonic()
    try:
        while True:
            step()
    except fx.PeerFailureError as e:
        print(f"PEER-FAILURE rank {r} after {time.monotonic() - t0:.2f}s: {e}")
        sys.exit(5)


def hang():
    """Rank 1 stops answering (sleeps) but stays alive: the others time out."""
    r = fx.rank()
    if r == 1:
        time.sleep(30)
        return
    t0 = time.monotonic()
    try:
        fx.allreduce(np.ones(10, np.float32))
    except fx.PeerFailureError as e:
        print(f"TIMEOUT rank {r} after {time.monotonic() - t0:.1f}s: {e}")
        sys.exit(6)


def shutdown_early():
    """Rank 0 shuts down while rank 1 still wants to reduce."""
    r = fx.rank()
    if r == 0:
        try:
            fx.shutdown()
        except fx.FastxferError as e:
            print(f"SHUTDOWN-ERROR rank 0: {type(e).__name__}: {e}")
            sys.exit(4)
        return
    try:
        fx.allreduce(np.ones(10, np.float32), name="late")
    except fx.FastxferError as e:
        print(f"ERROR rank {r}: {type(e).__name__}: {e}")
        sys.exit(4)


# ---- issue 15: the new dtypes and op, alltoall, reducescatter --------------------------------------

NEW_INTS = [np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16)]


def _wrap_sum(xs, dtype):
    u = dtype.str.replace("i", "u")
    acc = xs[0].view(u).copy()
    for x in xs[1:]:
        acc += x.view(u)
    return acc.view(dtype)


def _wrap_prod(xs, dtype):
    u = dtype.str.replace("i", "u") if dtype.kind in "iu" else dtype
    acc = xs[0].view(u).copy()
    for x in xs[1:]:
        acc = (acc * x.view(u)).astype(u)
    return acc.view(dtype)


def dtypes15():
    """Every new dtype x op, exact, with wrap-around; product on every dtype; broadcast and
    allgather of the new dtypes. Sizes cross the tests' window and bucket cap."""
    r, n_ranks = fx.rank(), fx.size()
    checked = 0
    for dtype in NEW_INTS + [np.dtype(np.int32), np.dtype(np.int64)]:
        info = np.iinfo(dtype)
        for n in (0, 1, 1001, 300_001):
            xs = [np.random.default_rng(100 * j + n).integers(info.min, info.max, n, endpoint=True, dtype=dtype)
                  for j in range(n_ranks)]
            s = _wrap_sum(xs, dtype)
            want = {"sum": s, "product": _wrap_prod(xs, dtype), "min": np.minimum.reduce(xs),
                    "max": np.maximum.reduce(xs),
                    "average": np.trunc(s.astype(np.float64) * (1.0 / n_ranks)).astype(dtype)}
            for op, w in want.items():
                got = fx.allreduce(xs[r], op=op)
                assert got.dtype == dtype and np.array_equal(got, w), f"{dtype} {op} n={n}: {got[:5]} vs {w[:5]}"
                checked += 1
    # bool: sum/max = or, min/product = and
    for n in (0, 7, 300_001):
        bs = [np.random.default_rng(7 * j + n).integers(0, 2, n).astype(bool) for j in range(n_ranks)]
        for op, w in (("sum", np.logical_or.reduce(bs)), ("max", np.logical_or.reduce(bs)),
                      ("min", np.logical_and.reduce(bs)), ("product", np.logical_and.reduce(bs))):
            got = fx.allreduce(bs[r], op=op)
            assert got.dtype == np.bool_ and np.array_equal(got, w), (op, n)
            checked += 1
    # product on the float dtypes: rank order, 16-bit in float32 rounded once
    for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16):
        xs = [((np.arange(1001) % 5) - 2 + 0.5 * j).astype(dtype) for j in range(n_ranks)]
        calc = np.float64 if dtype == np.float64 else np.float32
        acc = xs[0].astype(calc)
        for x in xs[1:]:
            acc = (acc * x.astype(calc)).astype(calc)
        got = fx.allreduce(xs[r], op="product")
        assert np.array_equal(got.astype(np.float64), acc.astype(dtype).astype(np.float64)), dtype.name
        checked += 1
    # broadcast and allgather move the new dtypes bit for bit
    for dtype in NEW_INTS + [np.dtype(np.bool_)]:
        x = (np.arange(200_003) * 7 + r).astype(dtype)
        assert np.array_equal(fx.broadcast(x, root=n_ranks - 1), (np.arange(200_003) * 7 + n_ranks - 1).astype(dtype))
        mine = (np.arange(3 * (r + 1)).reshape(r + 1, 3) + r).astype(dtype)
        want = np.concatenate([(np.arange(3 * (j + 1)).reshape(j + 1, 3) + j).astype(dtype) for j in range(n_ranks)])
        got = fx.allgather(mine)
        assert got.dtype == dtype and np.array_equal(got, want)
        checked += 2
    print(f"OK dtypes15 {checked} cases on rank {r}")


def _rows(j, k, rows, width, dtype):
    """The rows rank j sends to rank k: values that name both, so every misplaced row shows."""
    base = 1000 * j + 10 * k
    return ((base + np.arange(rows * width).reshape(rows, width)) % 127).astype(dtype)


def alltoall():
    r, n_ranks = fx.rank(), fx.size()
    cases = 0
    for dtype in (np.dtype(np.float32), np.dtype(np.int64), BF16, np.dtype(np.uint8), np.dtype(np.bool_)):
        for name, split_of in (("even", lambda j, k: 2),
                               ("uneven", lambda j, k: (j + 2 * k) % 4),
                               ("empty", lambda j, k: 0),
                               ("one-way", lambda j, k: 3 if k == 0 else 0),
                               ("large", lambda j, k: 20_000 + 1000 * j + k)):  # past the window
            width = 3
            splits = [split_of(r, k) for k in range(n_ranks)]
            x = np.concatenate([_rows(r, k, splits[k], width, dtype) for k in range(n_ranks)]) \
                if sum(splits) else np.zeros((0, width), dtype)
            got, rs = fx.alltoall(x, splits=None if name == "even" else splits)
            want = [_rows(j, r, split_of(j, r), width, dtype) for j in range(n_ranks)]
            assert rs.tolist() == [split_of(j, r) for j in range(n_ranks)], (name, rs)
            assert got.dtype == dtype and got.shape == (sum(w.shape[0] for w in want), width), (name, got.shape)
            assert np.array_equal(got, np.concatenate(want)), (dtype, name)
            cases += 1
    # several dimensions, and a tensor with no rows at all on one rank
    x = np.arange(n_ranks * 2 * 3 * 4, dtype=np.float64).reshape(n_ranks * 2, 3, 4) + 1000 * r
    got, rs = fx.alltoall(x)
    want = np.concatenate([np.arange(n_ranks * 24, dtype=np.float64).reshape(n_ranks * 2, 3, 4)[2 * r:2 * r + 2]
                           + 1000 * j for j in range(n_ranks)])
    assert np.array_equal(got, want) and rs.tolist() == [2] * n_ranks
    # async: several in flight
    hs = [fx.alltoall_async(np.full((n_ranks, 2), 10 * i + r, np.int32)) for i in range(5)]
    for i, h in enumerate(hs):
        got, _ = h.wait()
        assert got[:, 0].tolist() == [10 * i + j for j in range(n_ranks)]
    # bad splits: a clear error, and the group still works
    for bad, msg in (([1] * (n_ranks + 1), "one entry per rank"), ([5] + [0] * (n_ranks - 1), "add up to"),
                     ([-1] + [1] * (n_ranks - 1), ">= 0")):
        try:
            fx.alltoall(np.zeros((n_ranks - 2 if n_ranks > 2 else 1, 2)), splits=bad)
        except ValueError as e:
            assert msg in str(e), e
        else:
            raise AssertionError(f"splits {bad} accepted")
    if n_ranks > 1:
        try:
            fx.alltoall(np.zeros((n_ranks + 1, 2)))
        except ValueError as e:
            assert "divisible" in str(e), e
        else:
            raise AssertionError("an uneven default split was accepted")
    assert fx.allreduce(np.ones(2), op="sum").tolist() == [n_ranks] * 2
    print(f"OK alltoall {cases} cases on rank {r}")


def reducescatter():
    r, n_ranks = fx.rank(), fx.size()
    cases = 0

    def mine_of(full, rows):
        per = [rows // n_ranks + (j < rows % n_ranks) for j in range(n_ranks)]
        lo = sum(per[:r])
        return full[lo:lo + per[r]]

    for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16, np.dtype(np.int32),
                  np.dtype(np.int64), np.dtype(np.uint8), np.dtype(np.int16)):
        for rows in (0, 1, n_ranks - 1, n_ranks, 7, 100_003):  # fewer rows than ranks, uneven, past the window
            width = 2 if rows < 1000 else 1
            xs = [inputs(j, rows * width, dtype, seed=rows).reshape(rows, width) for j in range(n_ranks)]
            for op in ("sum", "average"):
                got = fx.reducescatter(xs[r], op=op)
                if dtype.kind in "iu":
                    s = _wrap_sum(xs, dtype)
                    full = s if op == "sum" else np.trunc(s.astype(np.float64) * (1 / n_ranks)).astype(dtype)
                else:
                    calc = np.float64 if dtype == np.float64 else np.float32
                    s = sum(x.astype(calc) for x in xs)
                    full = (s if op == "sum" else s * calc(1 / n_ranks)).astype(dtype)
                want = mine_of(full, rows)
                assert got.dtype == dtype and got.shape == want.shape, (dtype, rows, op, got.shape, want.shape)
                assert np.array_equal(got.astype(np.float64), want.astype(np.float64)), (dtype, rows, op)
                cases += 1
    # grouped: every tensor split by its own first dimension
    arrs = [np.full((5, 2), r + 1, np.float32), np.arange(3, dtype=np.int64) * (r + 1), np.ones((n_ranks, 1), bool)]
    got = fx.grouped_reducescatter(arrs, op="sum")
    tot = n_ranks * (n_ranks + 1) // 2
    assert np.array_equal(got[0], mine_of(np.full((5, 2), tot, np.float32), 5))
    assert np.array_equal(got[1], mine_of(np.arange(3, dtype=np.int64) * tot, 3))
    assert got[2].tolist() == [[True]]
    # pre/postscale multiply once, after the sum
    got = fx.reducescatter(np.full((n_ranks, 1), 2.0), op="sum", prescale=0.5, postscale=3.0)
    assert got.tolist() == [[3.0 * n_ranks]]
    print(f"OK reducescatter {cases} cases on rank {r}")


def join15():
    """join's stand-ins with the new op and dtypes: rank 0 reduces alone after the others joined,
    and gets its own values back (the neutral elements: 1 for product, and/or's identities for bool,
    the integer limits for min/max)."""
    r = fx.rank()
    if r == 0:
        cases = [(np.array([3, 5, 200], np.uint8), "product"), (np.array([True, False]), "min"),
                 (np.array([True, False]), "sum"), (np.array([-3, 9], np.int16), "max"),
                 (np.array([-3, 9], np.int8), "min"), (np.array([2.5, -1.0], np.float16), "product"),
                 (np.array([7, 1], np.uint16), "sum")]
        for x, op in cases:
            got = fx.allreduce(x, op=op)
            assert got.dtype == x.dtype and np.array_equal(got, x), (x.dtype, op, got)
    assert fx.join() == 0
    print(f"OK join15 on rank {r}")


def _engine_switches():
    """Voluntary context switches of this process's engine thread so far (it sleeps on a condition
    variable; each wake-up is one)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "fastxfer-engine":
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                return int(f.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError):
            continue
    raise SystemExit("no fastxfer-engine thread in this process")


def quiet_engine(calls=1000):
    """Synchronous allreduces run their rounds on the calling thread and leave the engine thread
    asleep: it wakes only for its idle check (every 50 ms), not once per call."""
    x = np.arange(1 << 18, dtype=np.float32)
    out = np.empty_like(x)
    fx.allreduce(x, out=out, op="sum")
    fx.barrier()
    before, t0 = _engine_switches(), time.monotonic()
    for _ in range(calls):
        fx.allreduce(x, out=out, op="sum")
    woke, took = _engine_switches() - before, time.monotonic() - t0
    assert np.array_equal(out, x * fx.size()), "wrong sum"
    allowed = took / 0.05 + 20  # the idle checks, and a margin for other wake-ups
    assert woke <= allowed, f"the engine thread woke {woke} times in {calls} synchronous calls ({took:.2f} s)"
    print(f"OK quiet_engine woke {woke} times in {calls} calls, {took:.2f} s, rank {fx.rank()}")


def _adasum_reference(vectors):
    """Horovod's Adasum of one tensor's per-rank values, in float64 (written here, apart from the
    engine's): pairs (0,1), (2,3), ... then their results over a binary tree; ranks past the largest
    power of two fold into the first ones first."""
    vs = [np.asarray(v, np.float64).ravel() for v in vectors]

    def pair(a, b):
        dot, an, bn = a @ b, a @ a, b @ b
        return (1.0 - dot / an / 2 if an >= 1e-8 else 1.0) * a + (1.0 - dot / bn / 2 if bn >= 1e-8 else 1.0) * b

    p = 1
    while p * 2 <= len(vs):
        p *= 2
    for k in range(p, len(vs)):
        vs[k - p] = pair(vs[k - p], vs[k])
    level = 1
    while level < p:
        for k in range(0, p, 2 * level):
            vs[k] = pair(vs[k], vs[k + level])
        level *= 2
    return vs[0]


def adasum():
    """op='adasum' on every float dtype, several tensors fused in one bucket (coefficients per
    tensor), sizes 0, 1 and past the staging window, float32 on a bf16 wire, pre/postscale: within
    rounding of the float64 reference, and the same bits on every rank."""
    import ml_dtypes

    r, n = fx.rank(), fx.size()
    tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 2e-6, "float64": 1e-12}
    checked = 0

    def check(label, got, inputs, dtype, scale=1.0):
        nonlocal checked
        want = _adasum_reference(inputs) * scale
        assert got.dtype == np.dtype(dtype), (label, got.dtype)
        err = np.max(np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), 1.0), initial=0.0)
        assert err <= tol[np.dtype(dtype).name if dtype is not ml_dtypes.bfloat16 else "bfloat16"], (label, err)
        rows = fx.allgather(got.view(np.uint8).reshape(1, -1))
        assert all(np.array_equal(rows[0], row) for row in rows), f"{label}: ranks differ"
        checked += 1

    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        # one bucket: tensors of every size, submitted back to back, each with its own direction
        sizes = [0, 1, 5, 1000, 7]
        ins = [[np.random.default_rng(1000 * j + k).standard_normal(m).astype(dtype) for k, m in enumerate(sizes)]
               for j in range(n)]
        hs = [fx.allreduce_async(a, op="adasum", name=f"ada.{np.dtype(dtype).name}.{k}") for k, a in enumerate(ins[r])]
        for k, h in enumerate(hs):
            check(f"{np.dtype(dtype).name}[{sizes[k]}]", h.wait(), [ins[j][k] for j in range(n)], dtype)
    big = [np.random.default_rng(j).standard_normal(3_000_000).astype(np.float32) + 0.1 * j for j in range(n)]
    check("float32[3M]", fx.allreduce(big[r], op="adasum"), big, np.float32)
    wire = [b[:4096].astype(ml_dtypes.bfloat16).astype(np.float32) for b in big]  # what travels
    got = fx.allreduce(big[r][:4096], op="adasum", compression="bf16")
    want = _adasum_reference(wire)
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0)) <= 1e-2
    checked += 1
    x = [np.linspace(-1, 1, 9) * (j + 1) + j for j in range(n)]
    check("float64 prescale 2 postscale 0.25", fx.allreduce(x[r], op="adasum", prescale=2.0, postscale=0.25),
          [2.0 * v for v in x], np.float64, 0.25)
    print(f"OK adasum rank {r}: {checked} checks", flush=True)


def eager():
    """The one-exchange path for small allreduces (docs/algorithms.md, "Small allreduces"): which
    buckets take it, exact results on both sides of its limit, ranks whose queues differ when a
    round starts, and a disagreement inside an offered run. Every rank must run the same buckets
    the same way: the counts of buckets per path are compared across ranks. Steps 1-4 check the
    limit's rule, so the tuner (on by default, and past its warm-up after the job's earlier modes)
    is off for them; step 5 checks the tuner."""
    from fastxfer.comm import group

    r, n = fx.rank(), fx.size()
    limit = 32 << 10  # FASTXFER_EAGER_KB's default, in packed bytes
    engine = group._current()[0]
    engine.set_eager_tuning(False)

    def delta(before):
        after = fx.engine_stats()
        return after["eager_buckets"] - before["eager_buckets"], after["chunks"] - before["chunks"]

    def rank_order_sum(xs):
        """The sum as the engine forms it: each host's ranks in rank order, then the hosts' partials
        in host order (one host: rank order)."""
        k = fx.local_size()
        parts = []
        for h in range(0, len(xs), k):
            acc = xs[h].copy()
            for x in xs[h + 1:h + k]:
                acc = acc + x
            parts.append(acc)
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc

    # 1. which path: at the limit with the records, one element over it through the chunks
    for numel, path in ((1, "eager"), (limit // 4, "eager"), (limit // 4 + 1, "chunks"), (limit // 8, "eager")):
        xs = [inputs(j, numel, np.float32, seed=numel) for j in range(n)]
        before = fx.engine_stats()
        got = fx.allreduce(xs[r], op="sum")
        assert np.array_equal(got, rank_order_sum(xs)), (numel, got[:4])
        eager_n, chunks = delta(before)
        assert (eager_n, chunks == 0) == ((1, True) if path == "eager" else (0, False)), (numel, eager_n, chunks)
    # bf16 on the wire packs 2 bytes an element: twice the float32 elements fit
    before = fx.engine_stats()
    fx.allreduce(inputs(r, limit // 2, np.float32), op="sum", compression="bf16")
    assert delta(before) == (1, 0), delta(before)

    # 2. random float32 averages (not small integers: rounding shows) give the chunk path's contract
    #    on both sides of the limit: summed in float32 as above, then times float32(1/size)
    rng = np.random.default_rng(11)
    for numel in (3, 4097, limit // 4, limit // 4 + 1, 50_000):
        xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
        got = fx.allreduce(xs[r], op="average")
        want = rank_order_sum(xs) * np.float32(1 / n)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"average n={numel}"
        got = fx.allreduce(xs[r], op="max", prescale=2.0, postscale=0.5)
        want = np.max(np.stack(xs) * np.float32(2.0), 0) * np.float32(0.5)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"max n={numel}"

    # 3. queues that differ when a round starts: rank 0 submits the whole run at once, the others one
    #    by one, so rank 0 offers more than its peers have queued; mixed dtypes and ops in the run
    plan = [(np.float32, "sum", 10), (np.float32, "sum", 700), (np.float64, "sum", 33), (np.float32, "max", 5),
            (np.int32, "sum", 2000), (np.float32, "sum", 9000), (np.float32, "sum", 17), (np.float32, "sum", 1)]
    before = fx.engine_stats()
    for rep in range(3):
        xs = [[inputs(j, k, dt, seed=100 * rep + i) for j in range(n)] for i, (dt, _, k) in enumerate(plan)]
        handles = []
        for i, (dt, op, k) in enumerate(plan):
            if r > 0:
                time.sleep(0.003)
            handles.append(fx.allreduce_async(xs[i][r], op=op))
        for i, (h, (dt, op, k)) in enumerate(zip(handles, plan)):
            got = h.wait()
            want = np.max(np.stack(xs[i]), 0) if op == "max" else rank_order_sum(xs[i])
            assert got.dtype == dt and np.array_equal(got, want), (rep, i)
    counts = fx.allgather(np.array([delta(before)], np.int64))
    assert (counts == counts[0]).all(), f"ranks ran different buckets: {counts.tolist()}"
    assert counts[0, 0] > 0, counts.tolist()

    # 4. a disagreement inside an offered run: the requests before it run, it fails on every rank,
    #    the next allreduce works
    a = fx.allreduce_async(np.full(6, r + 1.0, np.float32), op="sum", name="eager.ok")
    b = fx.allreduce_async(np.ones(6 + (r == n - 1), np.float32), op="sum", name="eager.bad")
    assert a.wait().tolist() == [n * (n + 1) / 2] * 6
    try:
        b.wait()
        raise AssertionError("a shape that differs on one rank went through")
    except fx.MismatchError as e:
        assert "eager.bad" in str(e) or "shape" in str(e), e
    assert fx.allreduce(np.full(3, 2.0, np.float32), op="sum").tolist() == [2.0 * n] * 3

    # 5. the tuner (FASTXFER_EAGER_TUNE, on again here): past its warm-up, trial rounds run both
    #    paths; every result exact, and every rank ran the same buckets the same way
    engine.set_eager_tuning(True)
    xs = [inputs(j, 4096, np.float32, seed=5) for j in range(n)]
    want, out = rank_order_sum(xs), np.empty(4096, np.float32)
    def tuned_16k():
        rows = [t for t in fx.engine_stats()["eager_tuning"] if t["bytes"] == 16384]
        return rows[0] if rows else {"offers": 0, "eager_rounds": 0, "chunk_rounds": 0}

    before, seen = fx.engine_stats(), tuned_16k()  # the job's earlier modes may have offered 16 KiB
    for i in range(600):
        fx.allreduce(xs[r], op="sum", out=out)
        assert np.array_equal(out, want), i
    row = tuned_16k()
    runs = {k: row[k] - seen[k] for k in ("offers", "eager_rounds", "chunk_rounds")}
    assert runs["offers"] == 600 and runs["eager_rounds"] > 0 and runs["chunk_rounds"] > 0, (runs, row)
    assert runs["eager_rounds"] + runs["chunk_rounds"] <= 600 and row["eager_median_s"] > 0, (runs, row)
    assert row["path"] == ("with the records" if row["eager_median_s"] <= row["chunk_median_s"] else "chunks"), row
    counts = fx.allgather(np.array([delta(before)], np.int64))
    assert (counts == counts[0]).all(), f"ranks ran different buckets: {counts.tolist()}"
    print(f"OK eager on rank {r}")


def info():
    from fastxfer.comm import group

    link = group.layout().inter_host
    print(f"INFO rank={fx.rank()} size={fx.size()} local_rank={fx.local_rank()} local_size={fx.local_size()} "
          f"link={link.transport if link else 'none'}")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "slow_attach":
        # rank 1 joins late, so the segment exists (created by rank 0) for a while
        if int(os.environ.get("FASTXFER_RANK", "0")) == 1:
            time.sleep(3)
        fx.init()
        fx.barrier()
        print(f"OK slow_attach on rank {fx.rank()}")
        fx.shutdown()
        sys.exit(0)
    fx.init()
    for mode in sys.argv[1].split(","):  # several modes share one job
        if mode == "sweep":
            sweep()
        elif mode == "compressed":
            compressed()
        elif mode == "collectives":
            collectives()
        elif mode == "bits16":
            bits16()
        elif mode == "mismatch":
            mismatch(sys.argv[2])
        elif mode == "die":
            die(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        elif mode == "hang":
            hang()
        elif mode == "shutdown_early":
            shutdown_early()
        elif mode == "quiet_engine":
            quiet_engine()
        elif mode == "info":
            info()
        elif mode == "join15":
            join15()
        elif mode == "dtypes15":
            dtypes15()
        elif mode == "alltoall":
            alltoall()
        elif mode == "reducescatter":
            reducescatter()
        elif mode == "adasum":
            adasum()
        elif mode == "eager":
            eager()
        else:
            raise SystemExit(f"unknown mode {mode}")
    fx.shutdown()
