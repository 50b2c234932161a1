// Scalar reference conversions between float32 and bf16 / fp16 bit patterns. Every SIMD path
// must produce exactly these bits; the tests check them against ml_dtypes and numpy too.
//
// Everything here has internal linkage (static inline) because it is included into
// translation units compiled with different target flags: a shared inline symbol could be
// resolved to the AVX-512 copy and then run on a CPU without AVX-512.
#pragma once
#include <cstdint>
#include <cstring>

namespace fastxfer {
namespace ref {

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 -> bfloat16, round to nearest, ties to even (as ml_dtypes / Eigen).
// - Finite values, subnormals included, are rounded on the bit pattern: adding 0x7fff plus the
//   lowest kept bit carries into the kept half exactly when the dropped half is above one half
//   ulp, or exactly one half and the kept part is odd. A carry out of the largest finite
//   exponent gives +-Inf, which is the correctly rounded overflow.
// - +-0 and +-Inf are exact.
// - Every NaN becomes the canonical quiet NaN with its sign (0x7fc0 / 0xffc0), as ml_dtypes
//   does; rounding the payload could otherwise carry a NaN into Inf.
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

// bfloat16 -> float32 is exact: the bf16 bits are the top half of the float32 (NaN payloads kept).
static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// float32 -> IEEE binary16, round to nearest, ties to even (bit-identical to numpy's astype).
// - |x| >= 65520 rounds to +-Inf (numpy's overflow result); +-Inf stays +-Inf.
// - Results below 2^-14 are binary16 subnormals, rounded to nearest-even on 2^-24 steps; values
//   at or below 2^-25 become +-0 (2^-25 itself is a tie and goes to the even 0).
// - NaN keeps its sign and the top 10 payload bits, and is never turned into Inf (if those
//   bits are all zero, the lowest one is set). Signalling NaNs are not quieted: numpy does not.
static inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t exp = a >> 23;
  uint32_t man = a & 0x7fffffu;
  if (exp == 0xffu) {
    if (man == 0) return static_cast<uint16_t>(sign | 0x7c00u);
    uint32_t p = man >> 13;
    return static_cast<uint16_t>(sign | 0x7c00u | (p ? p : 1u));
  }
  if (exp >= 143) return static_cast<uint16_t>(sign | 0x7c00u);  // |x| >= 2^16: overflow
  if (exp >= 113) {
    // Normal binary16 range: re-bias the exponent, round the 13 dropped mantissa bits. A carry
    // may ripple into the exponent (correct) and up to 0x7c00 (= Inf, correct overflow).
    uint32_t q = ((exp - 112) << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  if (exp < 102) return static_cast<uint16_t>(sign);  // |x| < 2^-25: rounds to zero
  // Subnormal binary16: value = sig * 2^(exp-150); in units of 2^-24 that is sig >> (126-exp).
  uint32_t sig = man | 0x800000u;
  uint32_t shift = 126 - exp;  // 14..24
  uint32_t q = sig >> shift;
  uint32_t rem = sig & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry to 0x400, the smallest normal
  return static_cast<uint16_t>(sign | q);
}

// IEEE binary16 -> float32 is exact (numpy's conversion; NaN payloads kept, not quieted).
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return bits_f32(sign);
  // Subnormal: man * 2^-24, renormalised into a float32 normal.
  uint32_t e = 113;
  while (!(man & 0x400u)) {
    man <<= 1;
    --e;
  }
  return bits_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
}

}  // namespace ref
}  // namespace fastxfer
