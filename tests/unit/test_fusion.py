"""Bucket planner and fused pack/unpack (fastxfer.fusion)."""

import ml_dtypes
import numpy as np
import pytest

from fastxfer.fusion import BucketPlanner, numpy_dtype, pack, unpack

BF16 = np.dtype(ml_dtypes.bfloat16)
MiB = 1 << 20


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def single(compression="none"):
    """A planner that puts everything of one dtype into one bucket."""
    return BucketPlanner(cap_bytes=1 << 30, first_cap_bytes=1 << 30, compression=compression)


def test_default_caps():
    p = BucketPlanner()
    assert p.cap_bytes == 25 * MiB and p.first_cap_bytes == 1 * MiB and p.compression == "none"


def test_plan_groups_in_order_under_cap_with_small_first_bucket():
    # 40 float32 tensors of 256 KiB = 10 MiB; first cap 1 MiB, cap 4 MiB
    specs = [((256 * 256,), np.float32)] * 40
    buckets = BucketPlanner(cap_bytes=4 * MiB, first_cap_bytes=1 * MiB).plan(specs)
    sizes = [len(b.tensors) for b in buckets]
    assert sizes == [4, 16, 16, 4]
    assert [i for b in buckets for i in b.tensors] == list(range(40))
    assert all(b.nbytes <= 4 * MiB for b in buckets) and buckets[0].nbytes <= 1 * MiB


def test_cap_counts_wire_bytes_after_compression():
    specs = [((256 * 256,), np.float32)] * 40  # 256 KiB each in float32, 128 KiB in bf16
    b32 = BucketPlanner(cap_bytes=4 * MiB, first_cap_bytes=4 * MiB).plan(specs)
    b16 = BucketPlanner(cap_bytes=4 * MiB, first_cap_bytes=4 * MiB, compression="bf16").plan(specs)
    assert [len(b.tensors) for b in b32] == [16, 16, 8]
    assert [len(b.tensors) for b in b16] == [32, 8]
    assert b16[0].wire_dtype == "bfloat16" and b16[0].dtype == "float32" and b16[0].compression == "bf16"
    assert b16[0].nbytes == 32 * 256 * 256 * 2


def test_dtypes_never_mix_and_only_float32_is_compressed():
    specs = [(100, np.float32), (7, np.int64), (50, np.float32), (3, np.float64), (9, np.int64), (5, BF16)]
    buckets = BucketPlanner(compression="fp16").plan(specs)
    by_dtype = {b.dtype: b for b in buckets}
    assert set(by_dtype) == {"float32", "int64", "float64", "bfloat16"}
    assert by_dtype["float32"].tensors == [0, 2] and by_dtype["float32"].wire_dtype == "float16"
    assert by_dtype["int64"].tensors == [1, 4] and by_dtype["int64"].wire_dtype == "int64"
    assert by_dtype["int64"].compression == "none"
    assert by_dtype["bfloat16"].wire_dtype == "bfloat16"
    # returned in the order they complete (by last tensor)
    assert [b.tensors[-1] for b in buckets] == [2, 3, 4, 5]


def test_oversized_tensor_gets_its_own_bucket():
    specs = [(10, np.float32), (3 * MiB, np.float32), (10, np.float32)]
    buckets = BucketPlanner(cap_bytes=1 * MiB, first_cap_bytes=1 * MiB).plan(specs)
    assert [b.tensors for b in buckets] == [[0], [1], [2]]
    assert buckets[1].numel == 3 * MiB


def test_offsets_are_64_byte_aligned_and_padding_is_zero(rng):
    sizes = [1, 17, 0, 33, 5, 100]
    tensors = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    for compression, esize in (("none", 4), ("bf16", 2), ("fp16", 2)):
        (b,) = single(compression).plan(tensors)
        assert all(o * esize % 64 == 0 for o in b.offsets)
        assert b.numels == sizes
        assert b.numel == b.offsets[-1] + sizes[-1]
        buf = np.full(b.numel, 7, numpy_dtype(b.wire_dtype))
        pack(b, tensors, out=buf)
        used = np.zeros(b.numel, bool)
        for o, n in zip(b.offsets, b.numels):
            used[o:o + n] = True
        assert np.all(bits(buf)[~used] == 0)


def test_plan_is_deterministic():
    rng = np.random.default_rng(1)
    dts = [np.float32, np.float64, np.int32, np.float16]
    specs = [((int(rng.integers(0, 50000)),), dts[int(rng.integers(0, 4))]) for _ in range(300)]
    p = BucketPlanner(cap_bytes=200_000, first_cap_bytes=50_000, compression="bf16")
    a, b = p.plan(specs), p.plan(list(specs))
    assert [(x.tensors, x.offsets, x.numel, x.wire_dtype) for x in a] == \
           [(x.tensors, x.offsets, x.numel, x.wire_dtype) for x in b]
    assert sorted(i for x in a for i in x.tensors) == list(range(300))


@pytest.mark.parametrize("compression", ["none", "bf16", "fp16"])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_pack_unpack_float32_roundtrip(rng, compression, threads):
    sizes = [3, 1000, 0, 300_001, 17, 250_000, 64, 1]
    tensors = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    (b,) = single(compression).plan(tensors)
    buf = pack(b, tensors, threads=threads)
    assert buf.dtype == numpy_dtype(b.wire_dtype) and buf.size == b.numel
    outs = unpack(b, buf, threads=threads)
    for t, o, off in zip(tensors, outs, b.offsets):
        if compression == "none":
            np.testing.assert_array_equal(bits(buf[off:off + t.size]), bits(t))
            np.testing.assert_array_equal(bits(o), bits(t))
        else:
            wire = numpy_dtype(b.wire_dtype)
            np.testing.assert_array_equal(bits(buf[off:off + t.size]), bits(t.astype(wire)))
            np.testing.assert_array_equal(bits(o), bits(t.astype(wire).astype(np.float32)))


@pytest.mark.parametrize("compression", ["none", "bf16", "fp16"])
def test_pack_and_unpack_scale_in_the_same_pass(rng, compression):
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (5, 4097, 600_000)]
    (b,) = single(compression).plan(tensors)
    pre, post = np.float32(0.5), np.float32(1 / 3)
    buf = pack(b, tensors, scale=pre)
    outs = unpack(b, buf, scale=post)
    wire = numpy_dtype(b.wire_dtype)
    for t, o in zip(tensors, outs):
        want = (t * pre).astype(wire).astype(np.float32) * post
        np.testing.assert_array_equal(bits(o), bits(want))


def test_unpack_into_given_arrays_in_place(rng):
    grads = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (10,), (2, 2, 2)]]
    (b,) = BucketPlanner(compression="bf16").plan(grads)
    buf = pack(b, grads)
    want = [g.astype(BF16).astype(np.float32) / np.float32(4) for g in grads]
    outs = unpack(b, buf, outs=grads, scale=0.25)
    assert all(o is g for o, g in zip(outs, grads))
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.float16, BF16])
def test_other_dtypes_travel_unchanged(rng, dtype):
    tensors = [(rng.standard_normal(n) * 1000).astype(dtype) for n in (1, 333, 70_000)]
    (b,) = single("bf16").plan(tensors)
    assert b.wire_dtype == np.dtype(dtype).name
    outs = unpack(b, pack(b, tensors, threads=3), threads=3)
    for t, o in zip(tensors, outs):
        np.testing.assert_array_equal(bits(o), bits(t))


def test_float64_scaling(rng):
    t = [rng.standard_normal(1001)]
    (b,) = BucketPlanner().plan(t)
    (o,) = unpack(b, pack(b, t, scale=2.0), scale=0.125)
    np.testing.assert_array_equal(o, t[0] * 2.0 * 0.125)


def test_many_small_tensors_across_threads_match_single_thread(rng):
    sizes = rng.integers(0, 5000, size=2000)
    tensors = [rng.standard_normal(int(n)).astype(np.float32) for n in sizes]
    (b,) = single("bf16").plan(tensors)
    one = pack(b, tensors, threads=1)
    np.testing.assert_array_equal(bits(pack(b, tensors, threads=4)), bits(one))


def test_errors_name_the_problem(rng):
    t = [np.ones(10, np.float32), np.ones(5, np.float32)]
    (b,) = BucketPlanner().plan(t)
    with pytest.raises(ValueError, match="got 1 tensors for a bucket of 2"):
        pack(b, t[:1])
    with pytest.raises(TypeError, match="tensor 1 must have dtype float32, not float64"):
        pack(b, [t[0], np.ones(5)])
    with pytest.raises(ValueError, match="tensor 0 has 11 elements, expected 10"):
        pack(b, [np.ones(11, np.float32), t[1]])
    with pytest.raises(ValueError, match="tensor 1 must be C-contiguous"):
        pack(b, [t[0], np.ones(10, np.float32)[::2]])
    with pytest.raises(ValueError, match="the bucket needs"):
        pack(b, t, out=np.empty(3, np.float32))
    with pytest.raises(ValueError, match="output 0 is read-only"):
        ro = np.empty(10, np.float32)
        ro.flags.writeable = False
        unpack(b, pack(b, t), outs=[ro, np.empty(5, np.float32)])
    # integers scale as Horovod's ScaleBuffer: in float64, truncated toward zero; bool cannot
    (bi,) = BucketPlanner().plan([np.ones(3, np.int32)])
    assert pack(bi, [np.array([3, -3, 5], np.int32)], scale=0.5)[:3].tolist() == [1, -1, 2]
    (bb,) = BucketPlanner().plan([np.ones(3, bool)])
    with pytest.raises(ValueError, match="bool buckets cannot be scaled"):
        pack(bb, [np.ones(3, bool)], scale=0.5)
    with pytest.raises(ValueError, match="cap_bytes must be >= 1"):
        BucketPlanner(cap_bytes=0)
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        BucketPlanner(compression="zip")
    with pytest.raises(TypeError, match="unsupported dtype 'complex64'"):
        BucketPlanner().plan([np.ones(3, np.complex64)])
    with pytest.raises(TypeError, match=r"tensor 0: expected a numpy array or a \(shape, dtype\) pair"):
        BucketPlanner().plan([3.5])
