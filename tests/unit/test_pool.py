"""The output pool (csrc/common/output_pool.cc, bound in csrc/bindings/pool.cc): arrays from _core.pool_empty are ordinary writable numpy
arrays, their memory is reused only once every array and view of it is gone, the cache stays under
its cap, and it holds up under threads and fork. fx.allreduce without out= takes its results there."""

import mmap
import os
import subprocess
import sys
import threading
import warnings

import ml_dtypes
import numpy as np
import pytest

import fastxfer as fx
from fastxfer import _core

MB = 1 << 20
PAGE = mmap.PAGESIZE


def addr(a):
    return a.__array_interface__["data"][0]


@pytest.fixture
def pool():
    """A pool with its default cap and nothing cached; restores the cap afterwards."""
    cap = _core.output_pool_stats()["cap_bytes"]
    _core.output_pool_trim()
    yield _core
    _core.set_output_pool_cap(cap)
    _core.output_pool_trim()


def test_arrays_are_ordinary_writable_numpy_arrays(pool):
    for shape, dtype in [((3, 5), np.float32), ((70_000,), ml_dtypes.bfloat16), ((0,), np.int64), ((), np.float64)]:
        a = pool.pool_empty(shape, np.dtype(dtype))
        assert type(a) is np.ndarray and a.shape == shape and a.dtype == np.dtype(dtype)
        assert a.flags.c_contiguous and a.flags.writeable and not a.flags.owndata
        assert a.base is not None and not isinstance(a.base, np.ndarray)  # the capsule owns the memory
        assert addr(a) % PAGE == 0
        a[...] = 7
        assert np.all(a == 7) and np.all(a.copy() == 7)


def test_large_buffers_are_huge_page_aligned(pool):
    a = pool.pool_empty((4 * MB,), np.dtype(np.uint8))
    assert addr(a) % (2 * MB) == 0


def test_memory_is_reused_only_after_the_array_is_gone(pool):
    a = pool.pool_empty((300_000,), np.dtype(np.float32))
    first = addr(a)
    b = pool.pool_empty((300_000,), np.dtype(np.float32))
    assert addr(b) != first  # a is alive: never handed out twice
    del a
    s0 = pool.output_pool_stats()
    c = pool.pool_empty((300_000,), np.dtype(np.float32))
    assert addr(c) == first
    s1 = pool.output_pool_stats()
    assert s1["hits"] == s0["hits"] + 1 and s1["misses"] == s0["misses"]
    # the same page-rounded size in another dtype and shape reuses it too
    nbytes = 300_000 * 4
    del c
    d = pool.pool_empty((nbytes // 2,), np.dtype(ml_dtypes.bfloat16))
    assert addr(d) == first
    del b, d


def test_a_view_keeps_the_buffer_alive(pool):
    a = pool.pool_empty((100_000,), np.dtype(np.float64))
    first = addr(a)
    a[:] = np.arange(100_000)
    view = a[10:20]
    del a
    b = pool.pool_empty((100_000,), np.dtype(np.float64))
    assert addr(b) != first
    b[:] = -1
    assert view.tolist() == list(range(10, 20))  # untouched by the new array
    del view
    c = pool.pool_empty((100_000,), np.dtype(np.float64))
    assert addr(c) == first


def test_live_arrays_never_overlap(pool):
    arrays = [pool.pool_empty((n,), np.dtype(np.uint8)) for n in [1, 4096, 4097, 65536, 3 * MB] * 8]
    spans = sorted((addr(a), addr(a) + a.nbytes) for a in arrays)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    stats = pool.output_pool_stats()
    assert stats["live_buffers"] >= len(arrays)
    del arrays
    assert pool.output_pool_stats()["live_buffers"] == stats["live_buffers"] - 40


def test_cached_bytes_stay_under_the_cap(pool):
    pool.set_output_pool_cap(3 * MB)
    arrays = [pool.pool_empty((MB,), np.dtype(np.uint8)) for _ in range(5)]
    s0 = pool.output_pool_stats()
    del arrays
    s1 = pool.output_pool_stats()
    assert s1["cap_bytes"] == 3 * MB
    assert s1["cached_bytes"] == 3 * MB and s1["cached_buffers"] == 3
    assert s1["evictions"] == s0["evictions"] + 2
    # a buffer larger than the cap is never cached
    big = pool.pool_empty((4 * MB,), np.dtype(np.uint8))
    del big
    assert pool.output_pool_stats()["cached_bytes"] == 3 * MB
    # lowering the cap evicts now; 0 caches nothing at all
    pool.set_output_pool_cap(MB)
    assert pool.output_pool_stats()["cached_bytes"] == MB
    pool.set_output_pool_cap(0)
    a = pool.pool_empty((MB,), np.dtype(np.uint8))
    del a
    assert pool.output_pool_stats()["cached_bytes"] == 0


def test_least_recently_released_is_evicted_first(pool):
    pool.set_output_pool_cap(2 * MB)
    a, b, c = (pool.pool_empty((n,), np.dtype(np.uint8)) for n in (MB, MB - PAGE, MB - 2 * PAGE))
    where = {n: addr(x) for n, x in ((1, a), (2, b), (3, c))}
    del a, b  # a first: the oldest
    del c  # over the cap: a goes
    assert addr(pool.pool_empty((MB - PAGE,), np.dtype(np.uint8))) == where[2]
    assert addr(pool.pool_empty((MB - 2 * PAGE,), np.dtype(np.uint8))) == where[3]


def test_threads_never_share_a_buffer(pool):
    errors = []

    def work(tid):
        try:
            for i in range(300):
                a = pool.pool_empty((20_000 + (i % 3) * 4096,), np.dtype(np.int32))
                a[:] = tid
                if i % 7 == 0:
                    threading.Event().wait(0.0005)  # let the others run while this one holds its buffer
                if not np.all(a == tid):
                    errors.append(f"thread {tid}: buffer changed under it at iteration {i}")
                    return
        except Exception as e:  # noqa: BLE001 - report it from the main thread
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert pool.output_pool_stats()["live_buffers"] == 0


def test_fork_while_other_threads_use_the_pool(pool):
    """The child of a fork taken while another thread works the pool can use (and give back to) its
    copy of the pool; neither side deadlocks or corrupts the other."""
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            a = pool.pool_empty((70_000,), np.dtype(np.float32))
            a[:] = 1

    inherited = pool.pool_empty((200_000,), np.dtype(np.float32))
    inherited[:] = 5
    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(5):
            with warnings.catch_warnings():  # newer Pythons warn about fork() with threads: that is the point
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # child: only this thread exists now
                code = 1
                try:
                    ok = bool(np.all(inherited == 5))
                    del_at = addr(inherited)
                    b = pool.pool_empty((200_000,), np.dtype(np.float32))
                    ok = ok and addr(b) != del_at
                    b[:] = 9
                    code = 0 if ok and np.all(inherited == 5) else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        stop.set()
        worker.join(timeout=60)
    assert np.all(inherited == 5)


@pytest.mark.parametrize("value, cap", [("1", MB), ("0", 0), ("0.5", MB // 2), ("", 256 * MB)])
def test_env_sets_the_cap(value, cap):
    env = dict(os.environ, FASTXFER_OUTPUT_POOL_MB=value)
    r = subprocess.run([sys.executable, "-c", "from fastxfer import _core; "
                        "print(_core.output_pool_stats()['cap_bytes'])"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == cap


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "5MB"])
def test_env_rejects_a_bad_cap(value):
    env = dict(os.environ, FASTXFER_OUTPUT_POOL_MB=value)
    r = subprocess.run([sys.executable, "-c", "import fastxfer"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert f"FASTXFER_OUTPUT_POOL_MB={value!r}: expected a number" in r.stderr and "MiB" in r.stderr


def test_allreduce_results_come_from_the_pool(pool):
    fx.init()
    try:
        x = np.arange(100_000, dtype=np.float32)
        y = fx.allreduce(x, op="sum")
        assert not y.flags.owndata and not isinstance(y.base, np.ndarray)
        np.testing.assert_array_equal(y, x)
        first = addr(y)
        del y
        s0 = pool.output_pool_stats()
        # a training loop: each step drops the previous result, the next step reuses its memory
        for step in range(3):
            for dtype in (np.float32, ml_dtypes.bfloat16):
                z = fx.allreduce(x.astype(dtype), op="sum")
                np.testing.assert_array_equal(z, x.astype(dtype))
                if dtype == np.float32:
                    assert addr(z) == first
                del z
        s1 = pool.output_pool_stats()
        assert s1["hits"] == s0["hits"] + 5 and s1["misses"] == s0["misses"] + 1  # bf16's first step
        assert s1["live_buffers"] == s0["live_buffers"]
        # small results stay ordinary numpy allocations
        small = fx.allreduce(np.ones(100, np.float32))
        assert small.flags.owndata
        # broadcast's result too
        got = fx.broadcast(x)
        assert not got.flags.owndata
        np.testing.assert_array_equal(got, x)
    finally:
        fx.shutdown()
