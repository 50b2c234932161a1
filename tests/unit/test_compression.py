"""fx.compress / fx.decompress and the fused 16-bit kernels, on every SIMD path the CPU has.

Ground truth is ml_dtypes (bf16) and numpy (fp16); each SIMD path must also match the scalar
reference bit for bit.
"""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import fastxfer as fx
from fastxfer import _core

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
WIRE = {"bf16": BF16, "fp16": F16}


@pytest.fixture(autouse=True)
def _quiet_numpy_fp_warnings():
    # The references cast NaN, Inf and overflowing values on purpose.
    with np.errstate(all="ignore"):
        yield


def bits32(a):
    return np.ascontiguousarray(a).view(np.uint32)


def bits16(a):
    return np.ascontiguousarray(a).view(np.uint16)


def edge_values():
    """Bit patterns where rounding is easy to get wrong."""
    pats = [
        0x00000000, 0x80000000,  # +-0
        0x7F800000, 0xFF800000,  # +-Inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7F812345, 0x7FFFFFFF, 0xFFFFFFFF,  # NaNs
        0x7F801FFF, 0x7F802000,  # NaN payloads that vanish / survive in fp16
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000, 0x00008000, 0x00018000,  # f32 subnormals
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # min normal, max finite, bf16 overflow ties
        0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF,  # bf16 ties to even (down, up) and near-ties
        0x3F801000, 0x3F803000, 0x3F800FFF,  # fp16 ties
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000,  # fp16 max / overflow
        0x38800000, 0x387FE000, 0x387FF000, 0x387FFFFF,  # fp16 min normal and the carry into it
        0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x33C00000, 0x34200000,  # fp16 subnormal/zero ties
        0x3F800000, 0xBF800000, 0x40490FDB,
    ]
    return np.array(pats, dtype=np.uint32).view(np.float32)


def random_bits(rng, n):
    """Uniform bit patterns, plus patterns with exponents in fp16's range (uniform bits rarely land there)."""
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    v = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    exp = rng.integers(98, 146, size=n, dtype=np.uint32)
    v = (v & np.uint32(0x807FFFFF)) | (exp << np.uint32(23))
    return np.concatenate([u, v, bits32(edge_values())]).view(np.float32)


def reference(x, kind):
    return x.astype(WIRE[kind])


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compress_random_bits_match_reference_library(simd, rng, kind):
    x = random_bits(rng, 1_000_000)  # 2M random patterns + edge cases per path and format
    got = fx.compress(x, kind)
    assert got.dtype == WIRE[kind]
    want = reference(x, kind)
    bad = np.flatnonzero(bits16(got) != bits16(want))
    assert bad.size == 0, f"{simd}: {bad.size} mismatches, first input {bits32(x)[bad[0]]:#010x}"


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compress_matches_scalar_reference(simd, rng, kind):
    x = random_bits(rng, 500_000)
    got = fx.compress(x, kind)
    _core._set_simd_level("scalar")
    want = fx.compress(x, kind)
    np.testing.assert_array_equal(bits16(got), bits16(want))


def test_edge_cases_exact(simd):
    x = edge_values()
    b = bits16(fx.compress(x, "bf16"))
    h = bits16(fx.compress(x, "fp16"))
    np.testing.assert_array_equal(b, bits16(x.astype(BF16)))
    np.testing.assert_array_equal(h, bits16(x.astype(F16)))
    u = bits32(x)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    # a NaN stays a NaN (exponent all ones, mantissa non-zero) in both formats
    assert np.all((b[nan] & 0x7F80) == 0x7F80) and np.all(b[nan] & 0x007F)
    assert np.all((h[nan] & 0x7C00) == 0x7C00) and np.all(h[nan] & 0x03FF)
    # fp16 overflow gives +-Inf; 65504 stays finite; 2^-25 ties to even zero
    f = x.view(np.float32)
    assert bits16(fx.compress(np.array([65520.0, -1e6, 65504.0, 2.0**-25], np.float32), "fp16")).tolist() == [
        0x7C00, 0xFC00, 0x7BFF, 0x0000]
    assert np.array_equal(np.signbit(fx.compress(f, "fp16").astype(np.float32))[~nan], np.signbit(f)[~nan])


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_decompress_every_16bit_pattern(simd, kind):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(WIRE[kind])
    got = fx.decompress(h)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(bits32(got), bits32(h.astype(np.float32)))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_lengths_and_unaligned_tails(simd, rng, n, offset):
    # specials placed at the very end, where the vector paths switch to masked or scalar tails
    base = random_bits(rng, (n + 16) // 2)[: n + offset].copy()
    if n >= 4:
        base[-4:] = np.array([0x7FA00000, 0x00000001, 0x387FF000, 0x3F808000], np.uint32).view(np.float32)
    x = base[offset:]
    assert x.flags.c_contiguous and x.size == n
    for kind in ("bf16", "fp16"):
        out = fx.compress(x, kind)
        np.testing.assert_array_equal(bits16(out), bits16(reference(x, kind)))
        back = fx.decompress(out)
        np.testing.assert_array_equal(bits32(back), bits32(out.astype(np.float32)))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_threads_give_identical_results(rng, kind):
    x = random_bits(rng, (1 << 20) + 11)  # large enough to be split across threads
    one = fx.compress(x, kind, threads=1)
    for t in (2, 3, 8):
        np.testing.assert_array_equal(bits16(fx.compress(x, kind, threads=t)), bits16(one))
        np.testing.assert_array_equal(bits32(fx.decompress(one, threads=t)), bits32(one.astype(np.float32)))
    np.testing.assert_array_equal(bits16(one), bits16(reference(x, kind)))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("n", [1023, 1024, 5000, 100_003])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_streaming_stores_give_identical_bits(simd, rng, kind, n, offset):
    # Non-temporal stores (used by the engine for large buckets) peel to alignment, stream the
    # middle and finish with a normal tail: every offset and length must give the same bits.
    x = random_bits(rng, n // 2 + 8)[: n + offset]
    wire = reference(x, kind)[offset:]
    out = np.empty(n + offset, np.float32)[offset:]
    want = bits32(wire.astype(np.float32))
    for scale in (1.0, 0.25):
        _core._set_stream_stores(True)
        try:
            _core.decompress_into(wire, out, kind, scale, 1)
        finally:
            _core._set_stream_stores(False)
        expect = want if scale == 1.0 else bits32(wire.astype(np.float32) * np.float32(scale))
        np.testing.assert_array_equal(bits32(out), expect)


def test_shapes_preserved_and_out_filled(rng):
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    out = np.empty((3, 5, 7), BF16)
    r = fx.compress(x, "bf16", out=out)
    assert r is out and r.shape == (3, 5, 7)
    np.testing.assert_array_equal(bits16(out), bits16(x.astype(BF16)))
    back = np.empty((3, 5, 7), np.float32)
    assert fx.decompress(out, out=back) is back
    np.testing.assert_array_equal(back, out.astype(np.float32))


def test_thread_with_flush_to_zero_still_exact(rng):
    # TensorFlow's threads run with FTZ/DAZ set; the kernels must not inherit it (the converted
    # subnormals would silently become zero). threads=1 runs on this, the calling, thread.
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * np.float32(1e-6),  # fp16 subnormals
                        bits32(rng.integers(1, 0x7FFFFF, 5000, dtype=np.uint32)).view(np.float32)])  # f32 subnormals
    x = x.view(np.uint32).view(np.float32)
    want_b, want_h = bits16(x.astype(BF16)), bits16(x.astype(F16))
    h = x.astype(F16)
    want_back = bits32(h.astype(np.float32))
    for level in fx.supported_simd_levels():
        _core._set_simd_level(level)
        was = _core._set_thread_flush_denormals(True)
        try:
            got_b = bits16(fx.compress(x, "bf16", threads=1))
            got_h = bits16(fx.compress(x, "fp16", threads=1))
            got_back = bits32(fx.decompress(h, threads=1))
        finally:
            _core._set_thread_flush_denormals(was)
            _core._set_simd_level(fx.supported_simd_levels()[-1])
        np.testing.assert_array_equal(got_b, want_b)
        np.testing.assert_array_equal(got_h, want_h)
        np.testing.assert_array_equal(got_back, want_back)


# ---- fused kernels used by the engine -------------------------------------------------------

@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, 1e-3])
def test_scale_compress_and_scale_decompress(simd, rng, kind, scale):
    x = np.concatenate([rng.standard_normal(100_003).astype(np.float32) * np.float32(100), edge_values()])
    out = np.empty(x.shape, WIRE[kind])
    _core.compress_into(x, out, kind, scale, 0)
    # scale == 1 skips the multiply (a multiply would quiet signalling NaNs before fp16 rounding)
    want = (x if scale == 1.0 else x * np.float32(scale)).astype(WIRE[kind])
    np.testing.assert_array_equal(bits16(out), bits16(want))
    back = np.empty(x.shape, np.float32)
    _core.decompress_into(out, back, kind, scale, 0)
    want_back = out.astype(np.float32) if scale == 1.0 else out.astype(np.float32) * np.float32(scale)
    np.testing.assert_array_equal(bits32(back), bits32(want_back))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_accumulate(simd, rng, kind):
    n = 70_001
    acc = rng.standard_normal(n).astype(np.float32)
    src = (rng.standard_normal(n) * 10).astype(WIRE[kind])
    want = acc + src.astype(np.float32)
    _core.accumulate(acc, src, kind, 0)
    np.testing.assert_array_equal(bits32(acc), bits32(want))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_sum_compress(simd, rng, kind):
    n = 70_001
    a = (rng.standard_normal(n) * 30).astype(WIRE[kind])
    b = (rng.standard_normal(n) * 30).astype(WIRE[kind])
    # include values whose sum overflows fp16 and NaN/Inf operands
    a[:4] = np.array([60000, np.inf, np.nan, -np.inf], np.float32).astype(WIRE[kind])
    b[:4] = np.array([60000, 1, 2, np.inf], np.float32).astype(WIRE[kind])
    out = np.empty(n, WIRE[kind])
    _core.sum_compress(a, b, out, kind, 0)
    want = (a.astype(np.float32) + b.astype(np.float32)).astype(WIRE[kind])
    np.testing.assert_array_equal(bits16(out), bits16(want))


# ---- argument errors ------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
    x = np.ones(10, np.float32)
    with pytest.raises(TypeError, match="dtype float32, not float64"):
        fx.compress(np.ones(10), "bf16")
    with pytest.raises(TypeError, match="numpy.ndarray, not list"):
        fx.compress([1.0, 2.0], "bf16")
    with pytest.raises(ValueError, match="C-contiguous"):
        fx.compress(np.ones(20, np.float32)[::2], "bf16")
    with pytest.raises(ValueError, match="'bf16' or 'fp16'"):
        fx.compress(x, "int8")
    with pytest.raises(TypeError, match="out must have dtype bfloat16, not float16"):
        fx.compress(x, "bf16", out=np.empty(10, np.float16))
    with pytest.raises(ValueError, match="shape"):
        fx.compress(x, "bf16", out=np.empty(11, BF16))
    ro = np.empty(10, BF16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fx.compress(x, "bf16", out=ro)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        fx.compress(x, "bf16", threads=0)
    with pytest.raises(TypeError, match="dtype bfloat16 or float16, not float32"):
        fx.decompress(x)
    with pytest.raises(ValueError, match="C-contiguous"):
        fx.decompress(np.ones(20, F16)[::2])
    # the native layer checks too, for callers that skip the Python wrapper
    with pytest.raises(TypeError, match="input must have dtype float32"):
        _core.compress_into(np.ones(4), np.empty(4, BF16), "bf16", 1.0, 0)
    with pytest.raises(ValueError, match="expected 4"):
        _core.compress_into(np.ones(4, np.float32), np.empty(5, BF16), "bf16", 1.0, 0)
    with pytest.raises(ValueError, match="'none'"):
        _core.compress_into(np.ones(4, np.float32), np.empty(4, BF16), "none", 1.0, 0)


# ---- SIMD level selection -------------------------------------------------------------------

def _import_with(level, cwd):
    env = dict(os.environ, FASTXFER_SIMD=level)
    return subprocess.run([sys.executable, "-c", "import fastxfer; print(fastxfer.simd_level())"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_best_level_is_chosen_by_default():
    levels = fx.supported_simd_levels()
    assert levels[0] == "scalar"
    assert fx.simd_level() == levels[-1]
    feats = _core.cpu_features()
    if feats.avx512_bf16 and feats.avx512bw:
        assert fx.simd_level() == "avx512bf16"
    elif feats.avx2 and feats.f16c:
        assert fx.simd_level() in ("avx2", "avx512")


@pytest.mark.parametrize("level", fx.supported_simd_levels())
def test_env_forces_level(level, tmp_path):
    r = _import_with(level, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == level


def test_env_rejects_unknown_level(tmp_path):
    r = _import_with("avx9000", tmp_path)
    assert r.returncode != 0
    assert "FASTXFER_SIMD='avx9000': expected one of scalar, avx2, avx512, avx512bf16" in r.stderr


def test_set_level_rejects_unknown_name():
    with pytest.raises(ValueError, match="expected one of scalar, avx2, avx512, avx512bf16"):
        _core._set_simd_level("sse9")


def test_ml_dtypes_is_imported_only_when_a_bfloat16_is_first_needed():
    """`import fastxfer` (every `fastxfer run` and every worker) does not pay ml_dtypes' import; float32,
    float16 and the name "bfloat16" still work, and a bf16 result is ml_dtypes' bfloat16."""
    code = """
import sys
import numpy as np
import fastxfer as fx
from fastxfer import _validate
loaded = lambda: "ml_dtypes" in sys.modules
assert not loaded(), "import fastxfer imported ml_dtypes"
fx.init()
assert fx.allreduce(np.arange(4, dtype=np.float32)).tolist() == [0, 1, 2, 3]
h = fx.compress(np.array([1.5, -2.0], np.float32), "fp16")
assert fx.decompress(h).tolist() == [1.5, -2.0] and not loaded()
s = fx.allreduce(np.float16([1.0, 3.0]), prescale=2.0)  # scaled in float32, as Horovod does
assert s.dtype == np.float16 and s.tolist() == [2.0, 6.0], s
assert not loaded(), "a float16 array imported ml_dtypes"
assert list(_validate.DTYPES)[3] == "bfloat16" and len(_validate.DTYPES) == 11
assert _validate.numpy_dtype("bfloat16").name == "bfloat16" and loaded()
import ml_dtypes
b = fx.compress(np.array([1.0, 3.0], np.float32), "bf16")
assert b.dtype == np.dtype(ml_dtypes.bfloat16) and fx.decompress(b).tolist() == [1.0, 3.0]
assert fx.allreduce(b).astype(np.float32).tolist() == [1.0, 3.0]
try:
    fx.allreduce(np.zeros(2, ml_dtypes.float8_e4m3fn))
except TypeError as e:
    assert "float8_e4m3fn" in str(e) and "bfloat16" in str(e), str(e)
else:
    raise AssertionError("a float8 array was accepted")
fx.shutdown()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("FASTXFER_")})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
