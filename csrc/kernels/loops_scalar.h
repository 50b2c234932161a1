// Element-at-a-time loops over the reference conversions: the whole scalar path, and the tails
// of the SIMD paths. Internal linkage for the same reason as reference.h.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/reference.h"

namespace fastxfer {
namespace scalar_loops {

struct Bf16 {
  static inline uint16_t enc(float f) { return ref::f32_to_bf16(f); }
  static inline float dec(uint16_t h) { return ref::bf16_to_f32(h); }
};
struct Fp16 {
  static inline uint16_t enc(float f) { return ref::f32_to_f16(f); }
  static inline float dec(uint16_t h) { return ref::f16_to_f32(h); }
};

// a + b, where b is the later rank's value: if a is NaN the result is a's NaN, quieted. x86 gives
// its first operand's NaN when both are NaN, but the compiler may swap the operands of a
// commutative add, so without this the sign and payload of NaN + NaN would depend on the build
// and the ISA. Every path adds this way (SIMD paths patch the rare NaN lanes the same way).
static inline float add_ordered(float a, float b) {
  float v = a + b;
  if (std::isnan(a)) v = ref::bits_f32(ref::f32_bits(a) | 0x00400000u);
  return v;
}

template <class C>
static inline void compress(const float* src, uint16_t* dst, size_t n, float scale) {
  if (scale == 1.0f) {
    for (size_t i = 0; i < n; ++i) dst[i] = C::enc(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = C::enc(src[i] * scale);
  }
}
template <class C>
static inline void decompress(const uint16_t* src, float* dst, size_t n, float scale) {
  if (scale == 1.0f) {
    for (size_t i = 0; i < n; ++i) dst[i] = C::dec(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = C::dec(src[i]) * scale;
  }
}
template <class C>
static inline void accumulate(float* acc, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = add_ordered(acc[i], C::dec(src[i]));
}
template <class C>
static inline void sum_compress(const uint16_t* a, const uint16_t* b, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = C::enc(C::dec(a[i]) + C::dec(b[i]));
}
template <class C>
static inline void sum2_direct(const float* own, const uint16_t* peer, uint16_t* dst, float* out, size_t n,
                               float scale) {
  for (size_t i = 0; i < n; ++i) {
    float v = C::dec(C::enc(own[i])) + C::dec(peer[i]);
    uint16_t d = C::enc(scale == 1.0f ? v : v * scale);
    dst[i] = d;
    out[i] = C::dec(d);
  }
}
template <class C>
static inline void sum2_wire(const uint16_t* a, const uint16_t* b, uint16_t* dst, uint16_t* out, size_t n,
                             float scale) {
  for (size_t i = 0; i < n; ++i) {
    float v = add_ordered(C::dec(a[i]), C::dec(b[i]));
    uint16_t d = C::enc(scale == 1.0f ? v : v * scale);
    dst[i] = d;
    if (out) out[i] = d;
  }
}
// The reference combine of reduce_block (kernels/reduce.cc), one element at a time.
template <class C>
static inline void min_accumulate(float* acc, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float a = acc[i], x = C::dec(src[i]);
    acc[i] = (a < x || std::isnan(a)) ? a : x;
  }
}
template <class C>
static inline void max_accumulate(float* acc, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float a = acc[i], x = C::dec(src[i]);
    acc[i] = (a > x || std::isnan(a)) ? a : x;
  }
}
static inline void sum2_f32(const float* a, const float* b, float* dst, float* out, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) {
    float v = a[i] + b[i];
    if (scale != 1.0f) v *= scale;
    dst[i] = v;
    out[i] = v;
  }
}
static inline void scale_f32(const float* src, float* dst, size_t n, float scale) {
  if (scale == 1.0f) {
    for (size_t i = 0; i < n; ++i) dst[i] = src[i];
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
  }
}
static inline void accumulate_f32(float* acc, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += src[i];
}

}  // namespace scalar_loops
}  // namespace fastxfer
