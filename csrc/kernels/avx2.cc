// AVX2 + F16C path, 8 floats per step. bf16 rounding is done on the integer bits (AVX2 has no
// bf16 instruction); fp16 uses vcvtps2ph/vcvtph2ps with the NaN lanes patched to numpy's bits
// (the hardware quiets signalling NaNs, numpy keeps them).
#include <immintrin.h>

#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/loops_scalar.h"

namespace fastxfer {
namespace {

inline __m256i nan_mask(__m256i u) {
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  return _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
}

// 8 x int32 holding 16-bit values -> 8 x uint16
inline __m128i narrow(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

struct Bf16 {
  using Scalar = scalar_loops::Bf16;
  static inline __m128i enc(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nanv = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                   _mm256_set1_epi32(0x7fc0));
    r = _mm256_blendv_epi8(r, nanv, nan_mask(u));
    return narrow(r);
  }
  static inline __m256 dec(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

struct Fp16 {
  using Scalar = scalar_loops::Fp16;
  static inline __m128i enc(__m256 x) {
    __m128i r = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i u = _mm256_castps_si256(x);
    __m256i m = nan_mask(u);
    if (__builtin_expect(_mm256_movemask_epi8(m) != 0, 0)) {
      // numpy: sign | 0x7c00 | top 10 payload bits, lowest bit set if those are all zero
      __m256i p = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffff)), 13);
      p = _mm256_or_si256(p, _mm256_and_si256(_mm256_cmpeq_epi32(p, _mm256_setzero_si256()), _mm256_set1_epi32(1)));
      __m256i nb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                   _mm256_or_si256(_mm256_set1_epi32(0x7c00), p));
      __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
      r = _mm_blendv_epi8(r, narrow(nb), m16);
    }
    return r;
  }
  static inline __m256 dec(__m128i h) {
    __m256 r = _mm256_cvtph_ps(h);
    __m128i m16 = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
    if (__builtin_expect(_mm_movemask_epi8(m16) != 0, 0)) {
      // keep the NaN payload exactly (numpy does; the hardware would quiet it)
      __m256i e = _mm256_cvtepu16_epi32(h);
      __m256i nb = _mm256_or_si256(
          _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(e, _mm256_set1_epi32(0x8000)), 16),
                          _mm256_set1_epi32(0x7f800000)),
          _mm256_slli_epi32(_mm256_and_si256(e, _mm256_set1_epi32(0x3ff)), 13));
      r = _mm256_blendv_ps(r, _mm256_castsi256_ps(nb), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(m16)));
    }
    return r;
  }
};

// a + b with a's NaN (quieted) in the lanes where a is NaN: scalar_loops::add_ordered, 8 lanes.
inline __m256 add_ordered(__m256 a, __m256 b) {
  __m256 v = _mm256_add_ps(a, b);
  __m256 a_nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  if (__builtin_expect(_mm256_movemask_ps(a_nan) != 0, 0))
    v = _mm256_blendv_ps(v, _mm256_or_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000))), a_nan);
  return v;
}

// The AVX2 path ignores stream_stores(): a 32-byte non-temporal store fills half a line, and with
// other stores in between the write-combining buffer is flushed half full (measured 2x slower in
// the two-rank reduce). The AVX-512 path streams whole 64-byte lines.

inline __m128i load8(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void store8(uint16_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

template <class C>
void compress(const float* src, uint16_t* dst, size_t n, float scale) {
  size_t i = 0;
  if (scale == 1.0f) {
    for (; i + 8 <= n; i += 8) store8(dst + i, C::enc(_mm256_loadu_ps(src + i)));
  } else {
    __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) store8(dst + i, C::enc(_mm256_mul_ps(_mm256_loadu_ps(src + i), s)));
  }
  scalar_loops::compress<typename C::Scalar>(src + i, dst + i, n - i, scale);
}

template <class C>
void decompress(const uint16_t* src, float* dst, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = C::dec(load8(src + i));
    _mm256_storeu_ps(dst + i, do_scale ? _mm256_mul_ps(x, s) : x);
  }
  scalar_loops::decompress<typename C::Scalar>(src + i, dst + i, n - i, scale);
}

template <class C>
void accumulate(float* acc, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, add_ordered(_mm256_loadu_ps(acc + i), C::dec(load8(src + i))));
  scalar_loops::accumulate<typename C::Scalar>(acc + i, src + i, n - i);
}

template <class C>
void sum_compress(const uint16_t* a, const uint16_t* b, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, C::enc(_mm256_add_ps(C::dec(load8(a + i)), C::dec(load8(b + i)))));
  scalar_loops::sum_compress<typename C::Scalar>(a + i, b + i, dst + i, n - i);
}

template <class C>
void sum2_direct(const float* own, const uint16_t* peer, uint16_t* dst, float* out, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_add_ps(C::dec(C::enc(_mm256_loadu_ps(own + i))), C::dec(load8(peer + i)));
    __m128i d = C::enc(do_scale ? _mm256_mul_ps(v, s) : v);
    store8(dst + i, d);
    _mm256_storeu_ps(out + i, C::dec(d));
  }
  scalar_loops::sum2_direct<typename C::Scalar>(own + i, peer + i, dst + i, out + i, n - i, scale);
}

template <class C>
void sum2_wire(const uint16_t* a, const uint16_t* b, uint16_t* dst, uint16_t* out, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = add_ordered(C::dec(load8(a + i)), C::dec(load8(b + i)));
    __m128i d = C::enc(do_scale ? _mm256_mul_ps(v, s) : v);
    store8(dst + i, d);
    if (out) store8(out + i, d);
  }
  scalar_loops::sum2_wire<typename C::Scalar>(a + i, b + i, dst + i, out ? out + i : nullptr, n - i, scale);
}

// (acc < x || isnan(acc)) ? acc : x, with the predicate given as a vcmpps immediate (LT or GT).
template <class C, int kPredicate>
inline void minmax_accumulate(float* acc, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(acc + i), x = C::dec(load8(src + i));
    __m256 keep = _mm256_or_ps(_mm256_cmp_ps(a, x, kPredicate), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    _mm256_storeu_ps(acc + i, _mm256_blendv_ps(x, a, keep));
  }
  if (kPredicate == _CMP_LT_OQ) scalar_loops::min_accumulate<typename C::Scalar>(acc + i, src + i, n - i);
  else scalar_loops::max_accumulate<typename C::Scalar>(acc + i, src + i, n - i);
}
template <class C>
void min_accumulate(float* acc, const uint16_t* src, size_t n) { minmax_accumulate<C, _CMP_LT_OQ>(acc, src, n); }
template <class C>
void max_accumulate(float* acc, const uint16_t* src, size_t n) { minmax_accumulate<C, _CMP_GT_OQ>(acc, src, n); }

void sum2_f32(const float* a, const float* b, float* dst, float* out, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    if (do_scale) v = _mm256_mul_ps(v, s);
    _mm256_storeu_ps(dst + i, v);
    _mm256_storeu_ps(out + i, v);
  }
  scalar_loops::sum2_f32(a + i, b + i, dst + i, out + i, n - i, scale);
}

void scale_f32(const float* src, float* dst, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(src + i);
    _mm256_storeu_ps(dst + i, do_scale ? _mm256_mul_ps(x, s) : x);
  }
  scalar_loops::scale_f32(src + i, dst + i, n - i, scale);
}

void accumulate_f32(float* acc, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_loadu_ps(src + i)));
  scalar_loops::accumulate_f32(acc + i, src + i, n - i);
}

}  // namespace

FASTXFER_DEFINE_KERNELS(kAvx2Kernels, "avx2");

}  // namespace fastxfer
