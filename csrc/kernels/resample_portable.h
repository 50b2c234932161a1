// The portable resampling loops, shared by the portable table and by the AVX-512 table's tails.
// Header-only with internal linkage: each SIMD translation unit gets its own copy, compiled with
// its own flags, so no AVX-512 instruction can leak into the path a plain x86-64 CPU runs.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fastxfer {
namespace {

typedef float v4f __attribute__((vector_size(16)));

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store4(float* p, v4f v) { std::memcpy(p, &v, sizeof(v)); }

// The portable row kernels (4-lane GCC vectors); the AVX-512 ones (resample_avx512.cc) take the
// same steps in the same order but fuse each multiply-add (FMA), so the two paths agree to ~1e-6.

// acc[j] = sum_k w[k] * rows[k][j] for j < len (rows are bytes), summed in order k = 0, 1, ...
// Up to 6 taps in one pass over the row (no round trips through acc); more in passes of 6.
template <int N>
__attribute__((always_inline)) inline void vertical_fixed(float* __restrict acc, const uint8_t* const* rows,
                                                          const float* w, size_t len, bool first) {
  const uint8_t* __restrict r[N];
  float wk[N];
  for (int k = 0; k < N; ++k) {
    r[k] = rows[k];
    wk[k] = w[k];
  }
  for (size_t j = 0; j < len; ++j) {
    float v = first ? wk[0] * static_cast<float>(r[0][j]) : acc[j] + wk[0] * static_cast<float>(r[0][j]);
    for (int k = 1; k < N; ++k) v += wk[k] * static_cast<float>(r[k][j]);
    acc[j] = v;
  }
}

__attribute__((always_inline)) inline void vertical_body(float* __restrict acc, const uint8_t* const* rows,
                                                         const float* w, int n, size_t len) {
  for (int k0 = 0; k0 < n; k0 += 6) {
    const bool first = k0 == 0;
    switch (std::min(6, n - k0)) {
      case 1: vertical_fixed<1>(acc, rows + k0, w + k0, len, first); break;
      case 2: vertical_fixed<2>(acc, rows + k0, w + k0, len, first); break;
      case 3: vertical_fixed<3>(acc, rows + k0, w + k0, len, first); break;
      case 4: vertical_fixed<4>(acc, rows + k0, w + k0, len, first); break;
      case 5: vertical_fixed<5>(acc, rows + k0, w + k0, len, first); break;
      default: vertical_fixed<6>(acc, rows + k0, w + k0, len, first); break;
    }
  }
}

// Horizontal filter of one output pixel: taps are grouped four to a 16-float block (block z holds
// taps 4z..4z+3, one RGBX pixel each); p[k] = sum over blocks of the tap-k products, and the pixel
// is (p[0] + p[2]) + (p[1] + p[3]) -- the order the AVX-512 transpose adds them in.
__attribute__((always_inline)) inline v4f horizontal_pixel(const float* a, const float* w, int blocks) {
  v4f p[4];
  for (int k = 0; k < 4; ++k) p[k] = load4(a + 4 * k) * load4(w + 4 * k);
  for (int z = 1; z < blocks; ++z)
    for (int k = 0; k < 4; ++k) p[k] += load4(a + 16 * z + 4 * k) * load4(w + 16 * z + 4 * k);
  return (p[0] + p[2]) + (p[1] + p[3]);
}

// Brightness, clamp to [0, 255], then (normalise) v * sc - off; RGBX -> RGB at dst.
__attribute__((always_inline)) inline void finish_pixel(float* dst, v4f v, v4f bright, v4f sc, v4f off,
                                                        bool normalise) {
  const v4f zero = {0.0f, 0.0f, 0.0f, 0.0f}, top = {255.0f, 255.0f, 255.0f, 255.0f};
  v = v * bright;
  v = v > zero ? v : zero;
  v = v < top ? v : top;
  if (normalise) v = v * sc - off;
  dst[0] = v[0];
  dst[1] = v[1];
  dst[2] = v[2];
}

// One output row from the vertically filtered row `acc`: horizontal filter, then finish_pixel,
// mirrored when `flip`. Pixels [from, ow).
__attribute__((always_inline)) inline void row_portable(float* dst, const float* acc, const int32_t* fx,
                                                        const float* w16, int blocks, int from, int ow, bool flip,
                                                        v4f bright, v4f sc, v4f off, bool normalise) {
  for (int x = from; x < ow; ++x) {
    const v4f v = horizontal_pixel(acc + fx[x], w16 + static_cast<size_t>(x) * blocks * 16, blocks);
    finish_pixel(dst + 3 * (flip ? ow - 1 - x : x), v, bright, sc, off, normalise);
  }
}

inline v4f lanes(const float* p) { return load4(p); }

}  // namespace
}  // namespace fastxfer
