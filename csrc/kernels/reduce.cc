// Reduction kernels. They work on blocks of kBlock elements so the float32 accumulator stays in
// L1 while the N inputs stream past it.
#include "kernels/reduce.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <limits>
#include <type_traits>

#include "kernels/compress.h"

namespace fastxfer {

namespace {

constexpr size_t kBlock = 2048;

// Integer sums and products wrap modulo 2^bits, through unsigned arithmetic (signed overflow
// would be undefined behaviour, and so would a uint16 * uint16 promoted to int); that is what MPI
// implementations do too (docs/algorithms.md).
template <class T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <class T>
inline T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b)));
  } else {
    return a + b;
  }
}

template <class T>
inline T mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b)));
  } else {
    return a * b;
  }
}

template <class T>
inline T combine(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
    case ReduceOp::kAdasum: return add(a, b);  // adasum is refused by the entry points (not element-wise)
    case ReduceOp::kProduct: return mul(a, b);
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>) return (a < b || std::isnan(a)) ? a : b;
      else return a < b ? a : b;
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) return (a > b || std::isnan(a)) ? a : b;
      else return a > b ? a : b;
  }
  return a;
}

// An integer scaled as Horovod scales one (ScaleBuffer: `output = scale_factor * input` with a
// double factor): the product in double, truncated toward zero. Saturates instead of the
// undefined behaviour of an out-of-range conversion (an average never gets there).
template <class T>
inline T scale_int(T v, double scale) {
  const double x = static_cast<double>(v) * scale;
  if (!(x == x)) return 0;
  if (x >= static_cast<double>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  if (x <= static_cast<double>(std::numeric_limits<T>::lowest())) return std::numeric_limits<T>::lowest();
  return static_cast<T>(x);
}

// acc[0, m) = scale * op over srcs[j][b, b + m), in rank order.
template <class T, class S>
inline void combine_block(ReduceOp op, const void* const* srcs, int nsrc, size_t b, size_t m, S scale, T* acc) {
  std::memcpy(acc, static_cast<const T*>(srcs[0]) + b, m * sizeof(T));
  for (int j = 1; j < nsrc; ++j) {
    const T* s = static_cast<const T*>(srcs[j]) + b;
    if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
      for (size_t i = 0; i < m; ++i) acc[i] = add(acc[i], s[i]);
    } else if (op == ReduceOp::kProduct) {
      for (size_t i = 0; i < m; ++i) acc[i] = mul(acc[i], s[i]);
    } else {
      for (size_t i = 0; i < m; ++i) acc[i] = combine(op, acc[i], s[i]);
    }
  }
  if (scale != S(1)) {
    if constexpr (std::is_integral_v<T>) {
      for (size_t i = 0; i < m; ++i) acc[i] = scale_int(acc[i], static_cast<double>(scale));
    } else {
      for (size_t i = 0; i < m; ++i) acc[i] = static_cast<T>(acc[i] * scale);
    }
  }
}

template <class T, class S>
void reduce_native(ReduceOp op, const void* const* srcs, int nsrc, void* dst, size_t n, S scale) {
  T acc[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    size_t m = std::min(kBlock, n - b);
    combine_block<T, S>(op, srcs, nsrc, b, m, scale, acc);
    std::memcpy(static_cast<T*>(dst) + b, acc, m * sizeof(T));
  }
}

// The element-wise combine of one 16-bit source into the float32 accumulator (rank j > 0).
// A product is accumulated in float32 too (decoded exactly, multiplied, rounded once at the end).
inline void combine_16bit(ReduceOp op, const WireKernels& k, float* acc, const uint16_t* s, size_t m) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: return k.accumulate(acc, s, m);
    case ReduceOp::kMin: return k.min_accumulate(acc, s, m);
    case ReduceOp::kMax: return k.max_accumulate(acc, s, m);
    case ReduceOp::kProduct: {
      ScopedStreamStores cached(false);  // the decoded block stays in L1
      float tmp[kBlock];
      k.decompress(s, tmp, m, 1.0f);
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] * tmp[i];
      return;
    }
  }
}

// bool: one byte per value, 0 or 1. sum and max are a logical or, min and product a logical and
// (so any non-zero byte counts as true and the result is always 0 or 1); there is no average.
void reduce_bool(ReduceOp op, const void* const* srcs, int nsrc, void* dst, size_t n) {
  if (op == ReduceOp::kAverage) throw std::invalid_argument("bool tensors have no average (use sum: a logical or)");
  const bool any = op == ReduceOp::kSum || op == ReduceOp::kMax;
  uint8_t acc[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    const uint8_t* s0 = static_cast<const uint8_t*>(srcs[0]) + b;
    for (size_t i = 0; i < m; ++i) acc[i] = s0[i] != 0;
    for (int j = 1; j < nsrc; ++j) {
      const uint8_t* s = static_cast<const uint8_t*>(srcs[j]) + b;
      if (any) {
        for (size_t i = 0; i < m; ++i) acc[i] = acc[i] | (s[i] != 0);
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] = acc[i] & (s[i] != 0);
      }
    }
    std::memcpy(static_cast<uint8_t*>(dst) + b, acc, m);
  }
}

// Wire and tensors both bf16/fp16. `out`, when not null, receives the same bits as dst (this
// rank's own tensor, for the direct form). Two ranks summing take one fused pass (sum2_wire);
// otherwise each block is decoded into a float32 accumulator that stays in L1, combined rank by
// rank, and rounded once.
void reduce_16bit(ReduceOp op, const WireKernels& k, const void* const* srcs, int nsrc, void* dst, void* out,
                  size_t n, float scale) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  uint16_t* o = static_cast<uint16_t*>(out);
  if (nsrc == 2 && (op == ReduceOp::kSum || op == ReduceOp::kAverage))
    return k.sum2_wire(static_cast<const uint16_t*>(srcs[0]), static_cast<const uint16_t*>(srcs[1]), d, o, n, scale);
  // The accumulator must stay in L1: decoding into it with streaming stores (on for a large
  // bucket's outputs) would send every block to memory and back, 4x slower.
  ScopedStreamStores cached(false);
  float acc[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    size_t m = std::min(kBlock, n - b);
    k.decompress(static_cast<const uint16_t*>(srcs[0]) + b, acc, m, 1.0f);
    for (int j = 1; j < nsrc; ++j) combine_16bit(op, k, acc, static_cast<const uint16_t*>(srcs[j]) + b, m);
    k.compress(acc, d + b, m, scale);
    if (o) std::memcpy(o + b, d + b, m * sizeof(uint16_t));
  }
}

template <class T, class S>
void reduce_native_direct(ReduceOp op, const void* const* srcs, int nsrc, void* dst, void* out, size_t n, S scale) {
  T acc[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    size_t m = std::min(kBlock, n - b);
    combine_block<T, S>(op, srcs, nsrc, b, m, scale, acc);
    std::memcpy(static_cast<T*>(dst) + b, acc, m * sizeof(T));
    std::memcpy(static_cast<T*>(out) + b, acc, m * sizeof(T));
  }
}

// Wire bf16/fp16, own contribution float32 (rounded here), output float32.
void reduce_16bit_direct(ReduceOp op, const WireKernels& k, const void* const* srcs, int nsrc, int self, void* dst,
                         void* out, size_t n, float scale) {
  float acc[kBlock];
  uint16_t own16[kBlock];
  uint16_t* d = static_cast<uint16_t*>(dst);
  float* o = static_cast<float*>(out);
  for (size_t b = 0; b < n; b += kBlock) {
    size_t m = std::min(kBlock, n - b);
    k.compress(static_cast<const float*>(srcs[self]) + b, own16, m, 1.0f);
    for (int j = 0; j < nsrc; ++j) {
      const uint16_t* s = j == self ? own16 : static_cast<const uint16_t*>(srcs[j]) + b;
      if (j == 0) {
        ScopedStreamStores cached(false);  // the accumulator stays in L1 (see reduce_16bit)
        k.decompress(s, acc, m, 1.0f);
      } else {
        combine_16bit(op, k, acc, s, m);
      }
    }
    k.compress(acc, d + b, m, scale);
    k.decompress(d + b, o + b, m, 1.0f);
  }
}

}  // namespace

void reduce_block_direct(ReduceOp op, DType wire, DType own, const void* const* srcs, int nsrc, int self,
                         void* dst, void* out, size_t n, double scale) {
  if (nsrc < 1 || self < 0 || self >= nsrc) throw std::invalid_argument("reduce_block_direct: bad source index");
  if (op == ReduceOp::kAdasum) throw std::invalid_argument("adasum is not an element-wise reduction (collectives/adasum.h)");
  ScopedIeeeFpEnv env;
  const CompressKernels& k = active_kernels();
  const bool sum2 = nsrc == 2 && (op == ReduceOp::kSum || op == ReduceOp::kAverage);
  if (sum2 && own == DType::kFloat32) {
    // the common two-rank case: one fused pass (float addition of two values is commutative)
    const float* peer = static_cast<const float*>(srcs[1 - self]);
    if (wire == DType::kFloat32)
      return k.sum2_f32(static_cast<const float*>(srcs[self]), peer, static_cast<float*>(dst),
                        static_cast<float*>(out), n, static_cast<float>(scale));
    if (wire == DType::kBFloat16 || wire == DType::kFloat16)
      return (wire == DType::kBFloat16 ? k.bf16 : k.fp16)
          .sum2_direct(static_cast<const float*>(srcs[self]), static_cast<const uint16_t*>(srcs[1 - self]),
                       static_cast<uint16_t*>(dst), static_cast<float*>(out), n, static_cast<float>(scale));
  }
  if (own == wire) {
    switch (wire) {
      case DType::kFloat32:
        return reduce_native_direct<float, float>(op, srcs, nsrc, dst, out, n, static_cast<float>(scale));
      case DType::kFloat64: return reduce_native_direct<double, double>(op, srcs, nsrc, dst, out, n, scale);
      case DType::kBFloat16:
      case DType::kFloat16:
        // bf16/fp16 tensors: srcs[self] is this rank's own tensor, already in the wire format
        return reduce_16bit(op, wire == DType::kBFloat16 ? k.bf16 : k.fp16, srcs, nsrc, dst, out, n,
                            static_cast<float>(scale));
      default: break;
    }
  } else if (own == DType::kFloat32 && (wire == DType::kBFloat16 || wire == DType::kFloat16)) {
    return reduce_16bit_direct(op, wire == DType::kBFloat16 ? k.bf16 : k.fp16, srcs, nsrc, self, dst, out, n,
                               static_cast<float>(scale));
  }
  throw std::invalid_argument(std::string("reduce_block_direct does not handle ") + dtype_name(own) + " on a " +
                              dtype_name(wire) + " wire");
}

void reduce_block(ReduceOp op, DType wire, const void* const* srcs, int nsrc, void* dst, size_t n, double scale) {
  if (nsrc < 1) throw std::invalid_argument("reduce_block needs at least one source");
  if (op == ReduceOp::kAdasum && nsrc > 1)
    throw std::invalid_argument("adasum is not an element-wise reduction (collectives/adasum.h)");
  ScopedIeeeFpEnv env;
  const CompressKernels& k = active_kernels();
  switch (wire) {
    case DType::kFloat32: reduce_native<float, float>(op, srcs, nsrc, dst, n, static_cast<float>(scale)); break;
    case DType::kFloat64: reduce_native<double, double>(op, srcs, nsrc, dst, n, scale); break;
    // Integers: `scale` (1/size for an average) multiplies in double and truncates toward zero,
    // as Horovod's ScaleBuffer does.
    case DType::kInt32: reduce_native<int32_t, double>(op, srcs, nsrc, dst, n, scale); break;
    case DType::kInt64: reduce_native<int64_t, double>(op, srcs, nsrc, dst, n, scale); break;
    case DType::kUInt8: reduce_native<uint8_t, double>(op, srcs, nsrc, dst, n, scale); break;
    case DType::kInt8: reduce_native<int8_t, double>(op, srcs, nsrc, dst, n, scale); break;
    case DType::kUInt16: reduce_native<uint16_t, double>(op, srcs, nsrc, dst, n, scale); break;
    case DType::kInt16: reduce_native<int16_t, double>(op, srcs, nsrc, dst, n, scale); break;
    case DType::kBool:
      if (scale != 1.0) throw std::invalid_argument("bool reductions cannot be scaled");
      reduce_bool(op, srcs, nsrc, dst, n);
      break;
    case DType::kBFloat16: reduce_16bit(op, k.bf16, srcs, nsrc, dst, nullptr, n, static_cast<float>(scale)); break;
    case DType::kFloat16: reduce_16bit(op, k.fp16, srcs, nsrc, dst, nullptr, n, static_cast<float>(scale)); break;
  }
}

}  // namespace fastxfer
