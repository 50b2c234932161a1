"""The framework-free API in one process, in this interpreter: calls before init, one-rank
semantics, argument errors, engine thread pinning, init/shutdown cycles."""

import os

import ml_dtypes
import numpy as np
import pytest

import fastxfer as fx


@pytest.fixture
def single():
    fx.init()
    yield
    fx.shutdown()


def test_calls_before_init_raise():
    assert not fx.is_initialized()
    for f in (fx.rank, fx.size, fx.local_rank, fx.local_size, fx.barrier):
        with pytest.raises(fx.FastxferError, match=r"call fastxfer.init\(\) first"):
            f()
    with pytest.raises(fx.FastxferError, match="init"):
        fx.allreduce(np.ones(3, np.float32))


def test_single_process_semantics(single):
    assert (fx.rank(), fx.size(), fx.local_rank(), fx.local_size()) == (0, 1, 0, 1)
    x = np.arange(10, dtype=np.float32) / 3
    np.testing.assert_array_equal(fx.allreduce(x), x)
    # compression rounds even on one rank: the result is what the wire carried
    np.testing.assert_array_equal(fx.allreduce(x, compression="bf16"),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(fx.allgather(np.ones((2, 2))), np.ones((2, 2)))
    # the two small allreduces travelled with the negotiation's records, not through the window
    stats = fx.engine_stats()
    assert (stats["eager_buckets"], stats["chunks"]) == (2, 0), stats


def test_out_that_overlaps_the_input_is_refused_and_in_place_is_exact(single):
    """Issue 34 row 8: a view of the input's buffer shifted by some elements was reduced with
    12,575,744 of 12,582,912 elements wrong."""
    buf = np.arange(1 << 16, dtype=np.float32)
    with pytest.raises(ValueError, match="out overlaps the input array without being it"):
        fx.allreduce(buf[:-1000], out=buf[1000:], op="sum")
    with pytest.raises(ValueError, match="out overlaps the input array"):
        fx.allreduce_async(buf[1000:], out=buf[:-1000], op="sum")
    assert np.array_equal(buf, np.arange(1 << 16, dtype=np.float32))  # nothing was written
    x = np.arange(1 << 16, dtype=np.float32)
    assert fx.allreduce(x, op="sum", out=x) is x and np.array_equal(x, np.arange(1 << 16, dtype=np.float32))


def test_plain_allreduce_shortcut_checks_what_the_long_way_checks(single):
    """fx.allreduce given at most op and compression besides array/out skips the Python checks after
    the first such call (collectives._plain_calls): what it refuses must still be refused, or taken
    the long way, with the same names and results."""
    from fastxfer.comm import collectives
    x = np.arange(1 << 12, dtype=np.float32)
    assert np.array_equal(fx.allreduce(x), x)
    assert np.array_equal(fx.allreduce(x, op="sum"), x)
    known = collectives._plain_calls
    assert known is not None and ("average", "none", np.dtype(np.float32)) in known[2]
    assert ("sum", "none", np.dtype(np.float32)) in known[2]
    # the shortcut now takes these (the long way's first check is made to fail, to show it is not
    # reached); each result is exact
    out = np.empty_like(x)
    long_way = collectives.check.array
    collectives.check.array = None
    try:
        assert fx.allreduce(x, out=out) is out and np.array_equal(out, x)
        assert fx.allreduce(x, out=x) is x and np.array_equal(x, np.arange(1 << 12, dtype=np.float32))
        assert fx.allreduce(x, op="sum", out=out) is out and np.array_equal(out, x)
    finally:
        collectives.check.array = long_way
    # a strided input (the long way makes it contiguous), a list, another dtype: right results
    y = np.arange(20, dtype=np.float32)[::2]
    assert np.array_equal(fx.allreduce(y), y)
    assert fx.allreduce([1.0, 2.0]).tolist() == [1.0, 2.0]
    assert fx.allreduce(np.arange(5, dtype=np.int64)).tolist() == [0, 1, 2, 3, 4]
    # refused as before, with the long way's messages, and nothing written
    buf = np.arange(1 << 16, dtype=np.float32)
    with pytest.raises(ValueError, match="out overlaps the input array without being it"):
        fx.allreduce(buf[:-1000], out=buf[1000:])
    assert np.array_equal(buf, np.arange(1 << 16, dtype=np.float32))
    with pytest.raises(ValueError, match=r"out must be float32\[4096\], not float64\[4096\]"):
        fx.allreduce(x, out=np.empty(x.shape, np.float64))
    with pytest.raises(TypeError, match="dtype complex64"):
        fx.allreduce(np.ones(3, np.complex64))
    with pytest.raises(TypeError, match="op='average' needs a numeric dtype"):
        fx.allreduce(np.ones(3, bool))
    with pytest.raises(ValueError, match="applies to float32 arrays; this one is float64"):
        fx.allreduce(np.ones(3), compression="bf16")
    with pytest.raises(ValueError, match="op must be"):
        fx.allreduce(x, op="nonsense")
    # a prescale of 2 (not the default object) is applied, never taken for the cached plain call
    assert np.array_equal(fx.allreduce(x, op="sum", prescale=2.0), 2 * x)
    # every call above that ran took the next automatic name, the shortcut's like the others'
    assert next(collectives._counter("allreduce")) == 9
    # a new engine: the shortcut forgets the old one and is made again by the next call
    fx.shutdown()
    assert collectives._plain_calls is None
    fx.init()
    assert np.array_equal(fx.allreduce(x), x)
    assert collectives._plain_calls[0] is not known[0]


def test_bad_arguments(single):
    with pytest.raises(TypeError, match="dtype complex64"):
        fx.allreduce(np.ones(3, np.complex64))
    with pytest.raises(ValueError, match="applies to float32 arrays; this one is float64"):
        fx.allreduce(np.ones(3), compression="bf16")
    with pytest.raises(ValueError, match="compression must be"):
        fx.allreduce(np.ones(3, np.float32), compression="zip")
    with pytest.raises(TypeError, match="op='average' needs a numeric dtype, not bool"):
        fx.allreduce(np.ones(3, bool))
    with pytest.raises(TypeError, match="bool arrays cannot be scaled"):
        fx.allreduce(np.ones(3, bool), op="sum", postscale=2.0)
    with pytest.raises(TypeError, match="op='adasum' combines floating-point data .* not int32"):
        fx.allreduce(np.ones(3, np.int32), op="adasum")
    with pytest.raises(ValueError, match="oob_allreduce does not take op='adasum'"):
        fx.oob_allreduce(np.ones(3, np.float32), op="adasum")
    with pytest.raises(ValueError, match="reducescatter takes op 'sum' or 'average', not 'adasum'"):
        fx.reducescatter(np.ones(4, np.float32), op="adasum")
    with pytest.raises(ValueError, match="op must be one of"):
        fx.allreduce(np.ones(3), op="prod")
    with pytest.raises(ValueError, match="reducescatter takes op 'sum' or 'average'"):
        fx.reducescatter(np.ones(3), op="max")
    with pytest.raises(ValueError, match="at least one dimension"):
        fx.reducescatter(np.float32(1.0))
    with pytest.raises(ValueError, match="at least one dimension"):
        fx.alltoall(np.float32(1.0))
    with pytest.raises(TypeError, match="splits must be a 1-D sequence of ints"):
        fx.alltoall(np.ones(3), splits=[1.5])
    with pytest.raises(ValueError, match=r"alltoall splits add up to 2 rows, but the tensor's first dimension is 3"):
        fx.alltoall(np.ones(3), splits=[2])
    with pytest.raises(ValueError, match=r"root must be a rank in 0..0"):
        fx.broadcast(np.ones(3), root=1)
    with pytest.raises(ValueError, match="at least one dimension"):
        fx.allgather(np.float32(1.0))
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        fx.allgather(np.ones((1,) * 9))
    with pytest.raises(ValueError, match=r"out must be float32\[3\]"):
        fx.allreduce(np.ones(3, np.float32), out=np.empty(4, np.float32))
    with pytest.raises(ValueError, match="oob_allreduce is for small arrays"):
        fx.oob_allreduce(np.ones(1 << 20))
    with pytest.raises(TypeError, match="name must be a str"):
        fx.allreduce(np.ones(3), name=3)
    # errors in arguments do not break the group
    np.testing.assert_array_equal(fx.allreduce(np.ones(3), op="sum"), np.ones(3))


def test_single_process_new_dtypes_alltoall_reducescatter(single):
    for dt in (np.uint8, np.int8, np.uint16, np.int16, np.bool_):
        x = np.arange(7).astype(dt)
        for op in ("sum", "min", "max", "product") + (("average",) if dt != np.bool_ else ()):
            got = fx.allreduce(x, op=op)
            assert got.dtype == x.dtype and np.array_equal(got, x), (dt, op)
        assert np.array_equal(fx.broadcast(x), x) and np.array_equal(fx.allgather(x), x)
    got, rs = fx.alltoall(np.arange(6).reshape(3, 2))
    assert np.array_equal(got, np.arange(6).reshape(3, 2)) and rs.tolist() == [3] and rs.dtype == np.int64
    got, rs = fx.alltoall(np.zeros((0, 4), np.float16), splits=[0])
    assert got.shape == (0, 4) and got.dtype == np.float16 and rs.tolist() == [0]
    assert np.array_equal(fx.reducescatter(np.arange(6.0).reshape(3, 2)), np.arange(6.0).reshape(3, 2))
    assert [a.shape for a in fx.grouped_reducescatter([np.ones((2, 2)), np.ones(5, np.int8)], op="sum")] == \
        [(2, 2), (5,)]


def test_engine_thread_is_pinned_to_the_given_cpus():
    def read(path):
        with open(path) as f:
            return f.read()

    cpu = sorted(os.sched_getaffinity(0))[-1]
    fx.init(engine_cpus=[cpu])
    try:
        tasks = f"/proc/{os.getpid()}/task"
        engine = [t for t in os.listdir(tasks) if read(f"{tasks}/{t}/comm").strip() == "fastxfer-engine"]
        assert len(engine) == 1
        status = read(f"{tasks}/{engine[0]}/status")
        allowed = [ln.split(":")[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")]
        assert allowed == [str(cpu)]
        assert fx.allreduce(np.ones(3), op="sum").tolist() == [1.0] * 3
    finally:
        fx.shutdown()
    with pytest.raises(ValueError, match="not all in this process's CPU set"):
        fx.init(engine_cpus=[10_000])
    with pytest.raises(fx.FastxferError, match="bad CPU list"):
        fx.init(engine_cpus="0-x")


def test_init_twice_is_harmless_and_shutdown_then_reinit(single):
    fx.init()
    assert fx.size() == 1
    fx.shutdown()
    with pytest.raises(fx.FastxferError):
        fx.rank()
    fx.init()
    assert fx.allreduce(np.ones(2), op="sum").tolist() == [1.0, 1.0]


def test_precreate_segment_makes_an_owner_only_reserved_file_once(tmp_path):
    """A process set's first rank creates its segment before any member waits for it (issue 34 row
    4): exclusively, mode 0600, at its full size; a name already taken, or a planted link, is refused
    with what is there, and the link's target is untouched."""
    import stat

    from fastxfer import _core

    path = tmp_path / "fastxfer-1-00-s1-ab"
    _core.precreate_segment(str(path), 2, 1 << 20, 1 << 20, 1024)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size > 2 * (2 << 20) and st.st_size % 4096 == 0
    with pytest.raises(fx.FastxferError, match=rf"refusing to create shared-memory segment {path}: a file owned by "
                                               r".* with mode 0600 is already there"):
        _core.precreate_segment(str(path), 2, 1 << 20, 1 << 20, 1024)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "fastxfer-1-00-s2-cd"
    link.symlink_to(target)
    with pytest.raises(fx.FastxferError, match="a symbolic link"):
        _core.precreate_segment(str(link), 2, 1 << 20, 1 << 20, 1024)
    assert target.read_bytes() == b"keep"
