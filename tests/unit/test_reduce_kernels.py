"""The engine's reduce kernel (kernels/reduce.cc, through _core._reduce_block) on the dtypes and the
op added for Horovod parity (issue 15): uint8/int8/uint16/int16 sums and products wrap modulo
2^bits, integer averages are Horovod's (sum times 1/size in double, truncated toward zero), bool
sums/max are a logical or and min/product a logical and, products of 16-bit floats accumulate in
float32 and round once. Exact, against numpy."""

import ml_dtypes
import numpy as np
import pytest

from fastxfer import _core

INTS = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64]


def reduce(op, xs, scale=1.0):
    out = np.empty_like(xs[0])
    _core._reduce_block(op, list(xs), out, scale)
    return out


def ranks(dtype, n_ranks, n=5003, seed=0):
    """The whole range of the dtype: sums and products overflow."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(seed)
    return [rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype) for _ in range(n_ranks)]


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
def test_integer_sum_product_min_max_wrap_exactly(dtype, n_ranks):
    xs = ranks(dtype, n_ranks)
    u = np.dtype(dtype).str.replace("i", "u")  # the unsigned twin: numpy wraps there without complaint
    want_sum = xs[0].view(u).copy()
    want_prod = xs[0].view(u).copy()
    for x in xs[1:]:
        want_sum += x.view(u)
        want_prod *= x.view(u)
    assert np.array_equal(reduce("sum", xs), want_sum.view(dtype))
    assert np.array_equal(reduce("product", xs), want_prod.view(dtype))
    assert np.array_equal(reduce("min", xs), np.minimum.reduce(xs))
    assert np.array_equal(reduce("max", xs), np.maximum.reduce(xs))


def test_wrap_around_by_hand():
    assert reduce("sum", [np.array([200, 255], np.uint8), np.array([100, 1], np.uint8)]).tolist() == [44, 0]
    assert reduce("sum", [np.array([127, -128], np.int8), np.array([1, -1], np.int8)]).tolist() == [-128, 127]
    assert reduce("sum", [np.array([65535], np.uint16), np.array([2], np.uint16)]).tolist() == [1]
    assert reduce("sum", [np.array([32767], np.int16), np.array([1], np.int16)]).tolist() == [-32768]
    # uint16 * uint16 would overflow int (C's promotion) without the unsigned detour
    assert reduce("product", [np.array([65535], np.uint16), np.array([65535], np.uint16)]).tolist() == [1]
    assert reduce("product", [np.array([16], np.int8), np.array([16], np.int8)]).tolist() == [0]
    assert reduce("product", [np.array([-128], np.int8), np.array([-1], np.int8)]).tolist() == [-128]
    i64 = np.iinfo(np.int64)
    assert reduce("sum", [np.array([i64.max], np.int64), np.array([1], np.int64)]).tolist() == [i64.min]


@pytest.mark.parametrize("dtype", INTS)
def test_integer_average_is_horovods_truncation(dtype):
    # Horovod: postscale_factor = 1/size, ScaleBuffer does output = scale_factor * input in double,
    # converted back to the integer type (truncation toward zero)
    for n_ranks in (2, 3, 4):
        xs = [np.arange(-20, 21).astype(dtype) * (j + 1) for j in range(n_ranks)] if np.iinfo(dtype).min < 0 else \
             [np.arange(0, 41).astype(dtype) * (j + 1) for j in range(n_ranks)]
        u = np.dtype(dtype).str.replace("i", "u")
        total = xs[0].view(u).copy()
        for x in xs[1:]:
            total += x.view(u)  # the sum wraps first, then it is scaled
        want = np.trunc(total.view(dtype).astype(np.float64) * (1.0 / n_ranks)).astype(dtype)
        assert np.array_equal(reduce("average", xs, 1.0 / n_ranks), want), (dtype, n_ranks)
    # negative averages truncate toward zero: (-3 + 0) / 2 = -1, not -2
    if np.iinfo(dtype).min < 0:
        assert reduce("average", [np.array([-3, 3], dtype), np.array([0, 0], dtype)], 0.5).tolist() == [-1, 1]
    # the average of a wrapped sum is the wrapped sum's average (as Horovod: the sum wraps first)
    if dtype == np.uint8:
        assert reduce("average", [np.array([200], dtype), np.array([100], dtype)], 0.5).tolist() == [22]


def test_horovods_double_rounding_is_kept():
    # 49 * (1/49) is 0.9999999999999999 in double: Horovod's average of 49 ones over 49 ranks is 0
    xs = [np.ones(3, np.int32)] * 49
    assert reduce("average", xs, 1.0 / 49).tolist() == [0, 0, 0]


def test_bool_or_and():
    a = np.array([False, False, True, True])
    b = np.array([False, True, False, True])
    assert reduce("sum", [a, b]).tolist() == [False, True, True, True]
    assert reduce("max", [a, b]).tolist() == [False, True, True, True]
    assert reduce("min", [a, b]).tolist() == [False, False, False, True]
    assert reduce("product", [a, b]).tolist() == [False, False, False, True]
    # any non-zero byte is true, and the result is 0 or 1
    raw = [np.array([0, 7, 0], np.uint8).view(bool), np.array([0, 0, 255], np.uint8).view(bool)]
    assert reduce("sum", raw).view(np.uint8).tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="no average"):
        reduce("average", [a, b])
    big = [np.random.default_rng(j).integers(0, 2, 10_007).astype(bool) for j in range(3)]
    assert np.array_equal(reduce("sum", big), np.logical_or.reduce(big))
    assert np.array_equal(reduce("min", big), np.logical_and.reduce(big))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_product_in_rank_order(dtype):
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(4099).astype(dtype) for _ in range(3)]
    assert np.array_equal(reduce("product", xs), (xs[0] * xs[1]) * xs[2])


@pytest.mark.parametrize("dtype", [np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)])
def test_16bit_product_accumulates_in_float32_and_rounds_once(dtype):
    rng = np.random.default_rng(4)
    xs = [(rng.standard_normal(4099) * 4).astype(dtype) for _ in range(3)]
    f = [x.astype(np.float32) for x in xs]
    want = ((f[0] * f[1]) * f[2]).astype(dtype)
    assert np.array_equal(reduce("product", xs).view(np.uint16), want.view(np.uint16))
    # scaled (the average's postscale path, here with product): scale in float32, round once
    want = (((f[0] * f[1]) * f[2]) * np.float32(0.5)).astype(dtype)
    assert np.array_equal(reduce("product", xs, 0.5).view(np.uint16), want.view(np.uint16))
