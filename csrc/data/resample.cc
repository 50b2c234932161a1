#include "data/resample.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/compress.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTXFER_RESAMPLE_AVX512 1
#define FASTXFER_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#else
#define FASTXFER_RESAMPLE_AVX512 0
#endif

namespace fastxfer {
namespace data {

namespace {

typedef float v4f __attribute__((vector_size(16)));

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store4(float* p, v4f v) { std::memcpy(p, &v, sizeof(v)); }

inline uint16_t to_bf16(float f) {  // round to nearest even (no NaN can reach here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline double clamp255(double v) { return std::min(std::max(v, 0.0), 255.0); }

// ---- the portable row kernels (4-lane GCC vectors); the AVX-512 ones below take the same steps
// in the same order but fuse each multiply-add (FMA), so the two paths agree to ~1e-6.

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
// is (p[0] + p[2]) + (p[1] + p[3]) -- the order the AVX-512 transpose below adds them in.
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

void vertical_portable(float* acc, const uint8_t* const* rows, const float* w, int n, size_t len) {
  vertical_body(acc, rows, w, n, len);
}
void row_portable_fn(float* dst, const float* acc, const int32_t* fx, const float* w16, int blocks, int ow, bool flip,
                     v4f bright, v4f sc, v4f off, bool normalise) {
  row_portable(dst, acc, fx, w16, blocks, 0, ow, flip, bright, sc, off, normalise);
}

#if FASTXFER_RESAMPLE_AVX512
FASTXFER_AVX512_TARGET inline __m512 bytes_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

FASTXFER_AVX512_TARGET inline __m512 bytes_to_ps(const uint8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// The vertical pass with fused multiply-adds, 32 floats per step (two independent chains).
FASTXFER_AVX512_TARGET void vertical_avx512(float* acc, const uint8_t* const* rows, const float* w, int n,
                                            size_t len) {
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

FASTXFER_AVX512_TARGET inline __m512 taps_avx512(const float* a, const float* w, int blocks) {
  __m512 v = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(w));
  for (int z = 1; z < blocks; ++z) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * z), _mm512_loadu_ps(w + 16 * z), v);
  return v;
}

// Four output pixels at a time: one register holds a pixel's four taps (block k = tap k); a 4x4
// transpose of 128-bit blocks adds them up as (t0 + t2) + (t1 + t3) for all four pixels at once,
// then brightness, clamp, normalise, RGBX -> RGB (mirrored when flipping) and a 12-float store.
FASTXFER_AVX512_TARGET void row_avx512(float* dst, const float* acc, const int32_t* fx, const float* w16,
                                       int blocks, int ow, bool flip, v4f bright4, v4f sc4, v4f off4,
                                       bool normalise) {
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
#endif

bool use_avx512() {
#if FASTXFER_RESAMPLE_AVX512
  return active_simd_level() >= SimdLevel::kAvx512;
#else
  return false;
#endif
}

}  // namespace

void make_taps(int start, int length, int out_len, Taps* t) {
  // Same arithmetic as kernels._weights: float64 geometry, float32 weights normalised by the
  // float64 sum of the unrounded ones.
  const double scale = static_cast<double>(length) / out_len;
  const double fscale = std::max(scale, 1.0);
  const double support = fscale;
  const int kmax = static_cast<int>(std::ceil(support)) * 2 + 1;
  t->out_len = out_len;
  t->taps = kmax;
  t->first.assign(out_len, 0);
  t->count.assign(out_len, 0);
  t->w.assign(static_cast<size_t>(out_len) * kmax, 0.0f);
  // Geometry relative to `start`, so the weights do not depend on where the crop lies (a tile
  // cut and the whole image give the same bits).
  for (int o = 0; o < out_len; ++o) {
    const double center = (o + 0.5) * scale;
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), length);
    const int n = std::max(0, std::min(hi - lo, kmax));
    float* w = &t->w[static_cast<size_t>(o) * kmax];
    double total = 0.0;
    for (int k = 0; k < n; ++k) {
      double v = 1.0 - std::fabs((lo + k - center + 0.5) / fscale);
      if (v < 0.0) v = 0.0;
      w[k] = static_cast<float>(v);
      total += v;
    }
    if (total > 0.0)
      for (int k = 0; k < n; ++k) w[k] = static_cast<float>(static_cast<double>(w[k]) / total);
    t->first[o] = start + lo;
    t->count[o] = n;
  }
  // Keep only as many taps per output as the widest one uses (the rest are zero weights).
  int used = 1;
  for (int o = 0; o < out_len; ++o) used = std::max(used, t->count[o]);
  if (used < kmax) {
    for (int o = 0; o < out_len; ++o)
      std::memmove(&t->w[static_cast<size_t>(o) * used], &t->w[static_cast<size_t>(o) * kmax], used * sizeof(float));
    t->w.resize(static_cast<size_t>(out_len) * used);
    t->taps = used;
  }
}

void U8Rows::read_row(int row, uint8_t* slot) {
  const uint8_t* p = data_ + (static_cast<size_t>(row) * width_ + x0_) * channels_;
  if (channels_ == 4) {
    std::memcpy(slot, p, static_cast<size_t>(cw_) * 4);
    return;
  }
  const int g = channels_ >= 3;
  for (int i = 0; i < cw_; ++i) {
    const uint8_t* q = p + static_cast<size_t>(i) * channels_;
    slot[4 * i] = q[0];
    slot[4 * i + 1] = q[g];
    slot[4 * i + 2] = q[2 * g];
    slot[4 * i + 3] = 0;
  }
}

void Resampler::run(RowSource& src, int y0, int x0, int ch, int cw, int oh, int ow, const Augment& aug,
                    const float mean[3], const float std_[3], void* out, OutType out_type) {
  const bool wide = use_avx512();
  make_taps(y0, ch, oh, &ty_);
  make_taps(x0, cw, ow, &tx_);
  const int ring_rows = ty_.taps;
  const size_t slot = src.slot_bytes();
  const size_t skip = static_cast<size_t>(src.slot_offset()) * 4;
  const size_t row_floats = static_cast<size_t>(cw) * 4;
  ring_.resize(ring_rows * slot);
  row_ptr_.resize(ring_rows);
  // Horizontal taps in blocks of four (zero weights past an output's own taps), each weight
  // repeated over the 4 lanes of a pixel; acc is padded so a block never reads past its end.
  const int blocks = (tx_.taps + 3) / 4;
  fx_.resize(ow);
  wx4_.assign(static_cast<size_t>(ow) * blocks * 16, 0.0f);
  for (int x = 0; x < ow; ++x) {
    fx_[x] = (tx_.first[x] - x0) * 4;
    for (int k = 0; k < tx_.taps; ++k) {
      float* w = &wx4_[(static_cast<size_t>(x) * blocks * 4 + k) * 4];
      w[0] = w[1] = w[2] = w[3] = tx_.w[static_cast<size_t>(x) * tx_.taps + k];
    }
  }
  acc_.assign(row_floats + static_cast<size_t>(blocks) * 16, 0.0f);

  const bool simple = aug.contrast == 1.0f && aug.saturation == 1.0f;
  float sc[3], off[3];
  for (int c = 0; c < 3; ++c) {
    sc[c] = 1.0f / (255.0f * std_[c]);
    off[c] = mean[c] / std_[c];
  }
  const v4f bright4 = {aug.brightness, aug.brightness, aug.brightness, aug.brightness};
  const v4f sc4 = {sc[0], sc[1], sc[2], 0.0f}, off4 = {off[0], off[1], off[2], 0.0f};
  // Rows go straight to a float32 output; bf16 and colour jitter go through pix_ first.
  const bool direct = simple && out_type == OutType::kFloat32;
  if (!direct) pix_.resize(static_cast<size_t>(oh) * ow * 3);
  float* out_f = static_cast<float*>(out);
  uint16_t* out_h = static_cast<uint16_t*>(out);

  int next_row = ty_.first[0];
  for (int o = 0; o < oh; ++o) {
    const int lo = ty_.first[o], n = ty_.count[o];
    for (; next_row < lo + n; ++next_row) src.read_row(next_row, &ring_[(next_row % ring_rows) * slot]);
    for (int k = 0; k < n; ++k) row_ptr_[k] = &ring_[((lo + k) % ring_rows) * slot] + skip;
    const float* wy = &ty_.w[static_cast<size_t>(o) * ty_.taps];
    float* dst = (direct ? out_f : pix_.data()) + static_cast<size_t>(o) * ow * 3;
#if FASTXFER_RESAMPLE_AVX512
    if (wide) {
      vertical_avx512(acc_.data(), row_ptr_.data(), wy, n, row_floats);
      row_avx512(dst, acc_.data(), fx_.data(), wx4_.data(), blocks, ow, aug.flip, bright4, sc4, off4, simple);
      continue;
    }
#endif
    vertical_portable(acc_.data(), row_ptr_.data(), wy, n, row_floats);
    row_portable_fn(dst, acc_.data(), fx_.data(), wx4_.data(), blocks, ow, aug.flip, bright4, sc4, off4, simple);
  }
  (void)wide;
  if (direct) return;
  const size_t total = static_cast<size_t>(oh) * ow;
  if (simple) {  // bf16 of exactly the float32 values
    for (size_t i = 0; i < 3 * total; ++i) out_h[i] = to_bf16(pix_[i]);
    return;
  }
  double gray_sum = 0.0;
  for (size_t i = 0; i < total; ++i)
    gray_sum += 0.299 * pix_[3 * i] + 0.587 * pix_[3 * i + 1] + 0.114 * pix_[3 * i + 2];
  const double gray_mean = gray_sum / static_cast<double>(total);
  const double con = aug.contrast, sat = aug.saturation;
  for (size_t i = 0; i < total; ++i) {
    double v[3] = {pix_[3 * i], pix_[3 * i + 1], pix_[3 * i + 2]};
    if (con != 1.0)
      for (double& c : v) c = clamp255((c - gray_mean) * con + gray_mean);
    if (sat != 1.0) {
      const double g = 0.299 * v[0] + 0.587 * v[1] + 0.114 * v[2];
      for (double& c : v) c = clamp255((c - g) * sat + g);
    }
    for (int c = 0; c < 3; ++c) {
      const float f = static_cast<float>(v[c] * sc[c] - off[c]);
      if (out_type == OutType::kFloat32)
        out_f[3 * i + c] = f;
      else
        out_h[3 * i + c] = to_bf16(f);
    }
  }
}

}  // namespace data
}  // namespace fastxfer
