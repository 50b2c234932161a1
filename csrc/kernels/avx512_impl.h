// AVX-512 path body, 16 floats per step, tails done with masked loads/stores (no scalar tail).
// Included by avx512.cc (bf16 rounded on the integer bits) and avx512bf16.cc
// (FASTXFER_NATIVE_BF16=1: vcvtneps2bf16). Everything is in an anonymous namespace, so the two
// copies, compiled with different flags, never get merged by the linker.
#include <immintrin.h>

#include "kernels/kernels.h"

// GCC 12 reports the undefined pass-through operand inside its own AVX-512 intrinsic headers
// (_mm512_undefined_* behind the masked loads and conversions) as "maybe uninitialized" once
// these helpers are inlined into many callers: a false positive, silenced for this header only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#ifndef FASTXFER_NATIVE_BF16
#error "define FASTXFER_NATIVE_BF16 before including avx512_impl.h"
#endif

namespace fastxfer {
namespace {

inline __mmask16 tail_mask(size_t r) { return static_cast<__mmask16>((1u << r) - 1u); }

// One vfpclassps for the lanes that need care: quiet NaN (0x01) | signalling NaN (0x80).
inline __mmask16 nan_mask(__m512 x) { return _mm512_fpclass_ps_mask(x, 0x81); }

inline __m256i bf16_round_bits(__m512i u) {
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __m512i nanv = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                                 _mm512_set1_epi32(0x7fc0));
  r = _mm512_mask_mov_epi32(r, nan_mask(_mm512_castsi512_ps(u)), nanv);
  return _mm512_cvtepi32_epi16(r);
}

struct Bf16 {
  static inline __m256i enc(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
#if FASTXFER_NATIVE_BF16
    // vcvtneps2bf16 rounds to nearest-even like the reference, but it treats subnormal inputs
    // as zero and keeps NaN payloads; those lanes (rare in gradients) take the integer path.
    __m256bh nb = _mm512_cvtneps_pbh(x);
    __m256i r;
    __builtin_memcpy(&r, &nb, sizeof(r));
    // quiet NaN | denormal | signalling NaN, in one vfpclassps
    __mmask16 special = _mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80);
    if (__builtin_expect(special != 0, 0)) r = _mm256_mask_mov_epi16(r, special, bf16_round_bits(u));
    return r;
#else
    return bf16_round_bits(u);
#endif
  }
  static inline __m512 dec(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

struct Fp16 {
  static inline __m256i enc(__m512 x) {
    __m256i r = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i u = _mm512_castps_si512(x);
    __mmask16 m = nan_mask(x);
    if (__builtin_expect(m != 0, 0)) {
      // numpy: sign | 0x7c00 | top 10 payload bits, lowest bit set if those are all zero
      __m512i p = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffff)), 13);
      __mmask16 z = _mm512_cmpeq_epi32_mask(p, _mm512_setzero_si512());
      p = _mm512_mask_mov_epi32(p, z, _mm512_set1_epi32(1));
      __m512i nb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                                   _mm512_or_si512(_mm512_set1_epi32(0x7c00), p));
      r = _mm256_mask_mov_epi16(r, m, _mm512_cvtepi32_epi16(nb));
    }
    return r;
  }
  static inline __m512 dec(__m256i h) {
    __m512 r = _mm512_cvtph_ps(h);
    __mmask16 m = _mm256_cmpgt_epu16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x7c00));
    if (__builtin_expect(m != 0, 0)) {
      // keep the NaN payload exactly (numpy does; the hardware would quiet it)
      __m512i e = _mm512_cvtepu16_epi32(h);
      __m512i nb = _mm512_or_si512(
          _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(e, _mm512_set1_epi32(0x8000)), 16),
                          _mm512_set1_epi32(0x7f800000)),
          _mm512_slli_epi32(_mm512_and_si512(e, _mm512_set1_epi32(0x3ff)), 13));
      r = _mm512_mask_mov_ps(r, m, _mm512_castsi512_ps(nb));
    }
    return r;
  }
};

// a + b with a's NaN (quieted) in the lanes where a is NaN: scalar_loops::add_ordered, 16 lanes.
inline __m512 add_ordered(__m512 a, __m512 b) {
  __m512 v = _mm512_add_ps(a, b);
  __mmask16 a_nan = nan_mask(a);
  if (__builtin_expect(a_nan != 0, 0))
    v = _mm512_mask_mov_ps(v, a_nan, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a),
                                                                         _mm512_set1_epi32(0x00400000))));
  return v;
}

// Runs f(i, k, full, stream) over [0, n) in steps of 16 floats. With streaming stores on, the
// head is peeled with a masked step until `out` is 64-byte aligned, and the aligned middle is
// flagged `stream` (the caller then uses _mm512_stream_ps), followed by a fence.
template <class F>
inline void for_each_16(size_t n, const float* out, F&& f) {
  size_t i = 0;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(out);
  if (stream_stores() && n >= kStreamMinElements && (addr & 3) == 0) {
    size_t peel = ((64 - (addr & 63)) & 63) / 4;
    if (peel) f(size_t(0), tail_mask(peel), false, false);
    for (i = peel; i + 16 <= n; i += 16) f(i, __mmask16(0xffff), true, true);
    _mm_sfence();
  }
  for (; i + 16 <= n; i += 16) f(i, __mmask16(0xffff), true, false);
  if (i < n) f(i, tail_mask(n - i), false, false);
}

inline void store_f32(float* p, __m512 v, __mmask16 k, bool full, bool stream) {
  if (stream) _mm512_stream_ps(p, v);
  else if (full) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, k, v);
}

inline __m256i load16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load16(const uint16_t* p, __mmask16 k) { return _mm256_maskz_loadu_epi16(k, p); }
inline void store16(uint16_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline void store16(uint16_t* p, __m256i v, __mmask16 k) { _mm256_mask_storeu_epi16(p, k, v); }

template <class C, bool kScale>
inline void compress_impl(const float* src, uint16_t* dst, size_t n, float scale) {
  __m512 s = _mm512_set1_ps(scale);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_loadu_ps(src + i);
    if (kScale) x = _mm512_mul_ps(x, s);
    store16(dst + i, C::enc(x));
  }
  if (i < n) {
    __mmask16 k = tail_mask(n - i);
    __m512 x = _mm512_maskz_loadu_ps(k, src + i);
    if (kScale) x = _mm512_mul_ps(x, s);
    store16(dst + i, C::enc(x), k);
  }
}
template <class C>
void compress(const float* src, uint16_t* dst, size_t n, float scale) {
  if (scale == 1.0f) compress_impl<C, false>(src, dst, n, scale);
  else compress_impl<C, true>(src, dst, n, scale);
}

template <class C, bool kScale>
inline void decompress_impl(const uint16_t* src, float* dst, size_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for_each_16(n, dst, [&](size_t i, __mmask16 k, bool full, bool stream) {
    __m512 x = C::dec(full ? load16(src + i) : load16(src + i, k));
    if (kScale) x = _mm512_mul_ps(x, s);
    store_f32(dst + i, x, k, full, stream);
  });
}
template <class C>
void decompress(const uint16_t* src, float* dst, size_t n, float scale) {
  if (scale == 1.0f) decompress_impl<C, false>(src, dst, n, scale);
  else decompress_impl<C, true>(src, dst, n, scale);
}

template <class C>
void accumulate(float* acc, const uint16_t* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, add_ordered(_mm512_loadu_ps(acc + i), C::dec(load16(src + i))));
  if (i < n) {
    __mmask16 k = tail_mask(n - i);
    __m512 x = add_ordered(_mm512_maskz_loadu_ps(k, acc + i), C::dec(load16(src + i, k)));
    _mm512_mask_storeu_ps(acc + i, k, x);
  }
}

template <class C>
void sum_compress(const uint16_t* a, const uint16_t* b, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) store16(dst + i, C::enc(_mm512_add_ps(C::dec(load16(a + i)), C::dec(load16(b + i)))));
  if (i < n) {
    __mmask16 k = tail_mask(n - i);
    store16(dst + i, C::enc(_mm512_add_ps(C::dec(load16(a + i, k)), C::dec(load16(b + i, k)))), k);
  }
}

template <class C>
void sum2_direct(const float* own, const uint16_t* peer, uint16_t* dst, float* out, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m512 s = _mm512_set1_ps(scale);
  for_each_16(n, out, [&](size_t i, __mmask16 k, bool full, bool stream) {
    __m512 mine = full ? _mm512_loadu_ps(own + i) : _mm512_maskz_loadu_ps(k, own + i);
    __m512 v = _mm512_add_ps(C::dec(C::enc(mine)), C::dec(full ? load16(peer + i) : load16(peer + i, k)));
    __m256i d = C::enc(do_scale ? _mm512_mul_ps(v, s) : v);
    if (full) store16(dst + i, d);
    else store16(dst + i, d, k);
    store_f32(out + i, C::dec(d), k, full, stream);
  });
}

inline __mmask32 tail_mask32(size_t r) { return static_cast<__mmask32>((uint64_t(1) << r) - 1u); }

// for_each_16 for 16-bit outputs: steps of 32 values, one 64-byte line each, so a streamed `out`
// is written in whole lines as well. `out` may be null (nothing to stream then).
template <class F>
inline void for_each_32(size_t n, const uint16_t* out, F&& f) {
  size_t i = 0;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(out);
  if (out && stream_stores() && n >= kStreamMinElements && (addr & 1) == 0) {
    size_t peel = ((64 - (addr & 63)) & 63) / 2;
    if (peel) f(size_t(0), tail_mask32(peel), false, false);
    for (i = peel; i + 32 <= n; i += 32) f(i, __mmask32(0xffffffffu), true, true);
    _mm_sfence();
  }
  for (; i + 32 <= n; i += 32) f(i, __mmask32(0xffffffffu), true, false);
  if (i < n) f(i, tail_mask32(n - i), false, false);
}

inline __m512i load32(const uint16_t* p, __mmask32 k, bool full) {
  return full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(k, p);
}
inline __m256i lo16(__m512i v) { return _mm512_castsi512_si256(v); }
inline __m256i hi16(__m512i v) { return _mm512_extracti64x4_epi64(v, 1); }

template <class C>
void sum2_wire(const uint16_t* a, const uint16_t* b, uint16_t* dst, uint16_t* out, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m512 s = _mm512_set1_ps(scale);
  for_each_32(n, out, [&](size_t i, __mmask32 k, bool full, bool stream) {
    const __m512i va = load32(a + i, k, full), vb = load32(b + i, k, full);
    __m512 lo = add_ordered(C::dec(lo16(va)), C::dec(lo16(vb)));
    __m512 hi = add_ordered(C::dec(hi16(va)), C::dec(hi16(vb)));
    if (do_scale) {
      lo = _mm512_mul_ps(lo, s);
      hi = _mm512_mul_ps(hi, s);
    }
    const __m512i d = _mm512_inserti64x4(_mm512_castsi256_si512(C::enc(lo)), C::enc(hi), 1);
    if (full) _mm512_storeu_si512(dst + i, d);
    else _mm512_mask_storeu_epi16(dst + i, k, d);
    if (out == nullptr) return;
    if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), d);
    else if (full) _mm512_storeu_si512(out + i, d);
    else _mm512_mask_storeu_epi16(out + i, k, d);
  });
}

// (acc < x || isnan(acc)) ? acc : x, with the predicate given as a vcmpps immediate (LT or GT).
template <class C, int kPredicate>
inline void minmax_accumulate(float* acc, const uint16_t* src, size_t n) {
  auto step = [&](size_t i, __mmask16 k, bool full) {
    const __m512 a = full ? _mm512_loadu_ps(acc + i) : _mm512_maskz_loadu_ps(k, acc + i);
    const __m512 x = C::dec(full ? load16(src + i) : load16(src + i, k));
    const __mmask16 keep = _mm512_cmp_ps_mask(a, x, kPredicate) | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    const __m512 r = _mm512_mask_blend_ps(keep, x, a);
    if (full) _mm512_storeu_ps(acc + i, r);
    else _mm512_mask_storeu_ps(acc + i, k, r);
  };
  size_t i = 0;
  for (; i + 16 <= n; i += 16) step(i, __mmask16(0xffff), true);
  if (i < n) step(i, tail_mask(n - i), false);
}
template <class C>
void min_accumulate(float* acc, const uint16_t* src, size_t n) { minmax_accumulate<C, _CMP_LT_OQ>(acc, src, n); }
template <class C>
void max_accumulate(float* acc, const uint16_t* src, size_t n) { minmax_accumulate<C, _CMP_GT_OQ>(acc, src, n); }

void sum2_f32(const float* a, const float* b, float* dst, float* out, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m512 s = _mm512_set1_ps(scale);
  for_each_16(n, out, [&](size_t i, __mmask16 k, bool full, bool stream) {
    __m512 v = full ? _mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i))
                    : _mm512_add_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i));
    if (do_scale) v = _mm512_mul_ps(v, s);
    store_f32(dst + i, v, k, full, false);
    store_f32(out + i, v, k, full, stream);
  });
}

void scale_f32(const float* src, float* dst, size_t n, float scale) {
  const bool do_scale = scale != 1.0f;
  const __m512 s = _mm512_set1_ps(scale);
  for_each_16(n, dst, [&](size_t i, __mmask16 k, bool full, bool stream) {
    __m512 x = full ? _mm512_loadu_ps(src + i) : _mm512_maskz_loadu_ps(k, src + i);
    store_f32(dst + i, do_scale ? _mm512_mul_ps(x, s) : x, k, full, stream);
  });
}

void accumulate_f32(float* acc, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(src + i)));
  if (i < n) {
    __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(acc + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + i), _mm512_maskz_loadu_ps(k, src + i)));
  }
}

}  // namespace
}  // namespace fastxfer
