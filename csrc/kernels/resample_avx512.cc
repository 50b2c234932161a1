// The AVX-512 resampling table: fused multiply-adds, 32 floats per vertical step, four output
// pixels per horizontal step. Compiled with its own -m flags (CMakeLists.txt), chosen at run time.
#include <immintrin.h>

#include "kernels/resample_kernels.h"
#include "kernels/resample_portable.h"

namespace fastxfer {

namespace {

inline __m512 bytes_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 bytes_to_ps(const uint8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// The vertical pass with fused multiply-adds, 32 floats per step (two independent chains).
void vertical_avx512(float* acc, const uint8_t* const* rows, const float* w, int n, size_t len) {
  const __m512 w0 = _mm512_set1_ps(w[0]);
  size_t j = 0;
  for (; j + 32 <= len; j += 32) {
    __m512 a = _mm512_mul_ps(w0, bytes_to_ps(rows[0] + j));
    __m512 b = _mm512_mul_ps(w0, bytes_to_ps(rows[0] + j + 16));
    for (int k = 1; k < n; ++k) {
      const __m512 wk = _mm512_set1_ps(w[k]);
      a = _mm512_fmadd_ps(wk, bytes_to_ps(rows[k] + j), a);
      b = _mm512_fmadd_ps(wk, bytes_to_ps(rows[k] + j + 16), b);
    }
    _mm512_storeu_ps(acc + j, a);
    _mm512_storeu_ps(acc + j + 16, b);
  }
  for (; j < len; j += 16) {
    const __mmask16 m = len - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - j)) - 1);
    __m512 a = _mm512_mul_ps(w0, bytes_to_ps(rows[0] + j, m));
    for (int k = 1; k < n; ++k) a = _mm512_fmadd_ps(_mm512_set1_ps(w[k]), bytes_to_ps(rows[k] + j, m), a);
    _mm512_mask_storeu_ps(acc + j, m, a);
  }
}

inline __m512 taps_avx512(const float* a, const float* w, int blocks) {
  __m512 v = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(w));
  for (int z = 1; z < blocks; ++z) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * z), _mm512_loadu_ps(w + 16 * z), v);
  return v;
}

// Four output pixels at a time: one register holds a pixel's four taps (block k = tap k); a 4x4
// transpose of 128-bit blocks adds them up as (t0 + t2) + (t1 + t3) for all four pixels at once,
// then brightness, clamp, normalise, RGBX -> RGB (mirrored when flipping) and a 12-float store.
void row_avx512(float* dst, const float* acc, const int32_t* fx, const float* w16, int blocks, int ow, bool flip,
                const float* bright_p, const float* sc_p, const float* off_p, bool normalise) {
  const v4f bright4 = lanes(bright_p), sc4 = lanes(sc_p), off4 = lanes(off_p);
  const __m512 bright = _mm512_broadcast_f32x4(reinterpret_cast<__m128>(bright4));
  const __m512 sc = _mm512_broadcast_f32x4(reinterpret_cast<__m128>(sc4));
  const __m512 off = _mm512_broadcast_f32x4(reinterpret_cast<__m128>(off4));
  const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(255.0f);
  const __m512i keep = _mm512_setr_epi32(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 0, 0, 0, 0);
  const __m512i mirror = _mm512_setr_epi32(12, 13, 14, 8, 9, 10, 4, 5, 6, 0, 1, 2, 0, 0, 0, 0);
  const __m512i order = flip ? mirror : keep;
  const size_t wstride = static_cast<size_t>(blocks) * 16;
  const int full = ow / 4 * 4;
  for (int x = 0; x < full; x += 4) {
    const float* w = w16 + static_cast<size_t>(x) * wstride;
    const __m512 A = taps_avx512(acc + fx[x], w, blocks);
    const __m512 B = taps_avx512(acc + fx[x + 1], w + wstride, blocks);
    const __m512 C = taps_avx512(acc + fx[x + 2], w + 2 * wstride, blocks);
    const __m512 D = taps_avx512(acc + fx[x + 3], w + 3 * wstride, blocks);
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, 0x44), _mm512_shuffle_f32x4(C, D, 0xEE));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    v = _mm512_mul_ps(v, bright);
    v = _mm512_min_ps(_mm512_max_ps(v, zero), top);
    if (normalise) v = _mm512_sub_ps(_mm512_mul_ps(v, sc), off);
    const int at = flip ? ow - 4 - x : x;
    _mm512_mask_storeu_ps(dst + 3 * at, 0x0FFF, _mm512_permutexvar_ps(order, v));
  }
  row_portable(dst, acc, fx, w16, blocks, full, ow, flip, bright4, sc4, off4, normalise);
}

}  // namespace

const ResampleKernels kAvx512Resample = {"avx512", vertical_avx512, row_avx512};

}  // namespace fastxfer
