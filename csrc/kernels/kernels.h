// The table of compression kernels one SIMD level provides, and the levels built into this binary.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fastxfer {

// Kernels for one 16-bit wire format (bf16 or fp16). All take element counts; buffers may
// be unaligned; src and dst must not overlap (except acc in accumulate, which is read and written).
// `scale` multiplies in float32 before rounding (scale == 1 skips the multiply entirely, so
// NaN payloads reach the rounding step untouched).
struct WireKernels {
  void (*compress)(const float* src, uint16_t* dst, size_t n, float scale);
  void (*decompress)(const uint16_t* src, float* dst, size_t n, float scale);
  // acc[i] += decode(src[i]); where acc[i] is NaN it stays that NaN (quieted), whatever src holds
  // (scalar_loops::add_ordered: NaN + NaN must not depend on how the compiler ordered the add)
  void (*accumulate)(float* acc, const uint16_t* src, size_t n);
  // dst[i] = encode(decode(a[i]) + decode(b[i])): two ranks' compressed shards reduced in float32
  void (*sum_compress)(const uint16_t* a, const uint16_t* b, uint16_t* dst, size_t n);
  // The two-rank reduce step in one pass: this rank's float32 value is rounded to the wire format
  // (as packing would), added to the peer's wire value in float32, scaled, rounded:
  //   dst[i] = encode(scale * (decode(encode(own[i])) + decode(peer[i])));  out[i] = decode(dst[i])
  // (a + b == b + a exactly, so rank order does not matter with two ranks.)
  void (*sum2_direct)(const float* own, const uint16_t* peer, uint16_t* dst, float* out, size_t n, float scale);
  // The two-rank reduce step for tensors that are themselves bf16/fp16 (no float32 anywhere in
  // memory), in rank order (a: rank 0, b: rank 1), widened to float32, added, scaled, rounded once:
  //   d = encode(scale * (decode(a[i]) + decode(b[i])));  dst[i] = d;  out[i] = d (if out != null)
  // (the add as in accumulate: a's NaN wins). dst may alias a or b (every element is read before
  // it is written); out may not.
  void (*sum2_wire)(const uint16_t* a, const uint16_t* b, uint16_t* dst, uint16_t* out, size_t n, float scale);
  // acc[i] = min / max(acc[i], decode(src[i])), NaN-propagating with acc's NaN first, exactly as
  // reduce_block's float combine: (acc < x || isnan(acc)) ? acc : x  (and > for max).
  void (*min_accumulate)(float* acc, const uint16_t* src, size_t n);
  void (*max_accumulate)(float* acc, const uint16_t* src, size_t n);
};

struct CompressKernels {
  const char* name;
  WireKernels bf16;
  WireKernels fp16;
  void (*scale_f32)(const float* src, float* dst, size_t n, float scale);  // copy when scale == 1
  void (*accumulate_f32)(float* acc, const float* src, size_t n);
  // dst[i] = out[i] = scale * (a[i] + b[i]): the uncompressed two-rank reduce step in one pass
  void (*sum2_f32)(const float* a, const float* b, float* dst, float* out, size_t n, float scale);
};

// Whether kernels writing results to a tensor (decompress, scale_f32, sum2_*: the `out`/`dst`
// float stream, and sum2_wire's 16-bit `out`) use non-temporal stores on this thread. Set by the
// shared-memory allreduce (collectives/shm_allreduce.cc) for large buckets, whose outputs would
// only evict the data it still has to read; results are identical either way.
// Off by default (fx.compress/decompress keep their output in cache). Only the AVX-512 paths
// stream (whole 64-byte lines); AVX2 and scalar ignore the switch.
bool stream_stores();
class ScopedStreamStores {
 public:
  explicit ScopedStreamStores(bool on);
  ~ScopedStreamStores();
  ScopedStreamStores(const ScopedStreamStores&) = delete;
  ScopedStreamStores& operator=(const ScopedStreamStores&) = delete;

 private:
  bool saved_;
};
// Shorter runs are not worth the peeling and the fence.
constexpr size_t kStreamMinElements = 1024;

// Each SIMD translation unit defines the same templates (compress<C>, decompress<C>, ...) and
// builds its table with this macro.
#define FASTXFER_WIRE_KERNELS(C)                                                     \
  {compress<C>,    decompress<C>, accumulate<C>,     sum_compress<C>, sum2_direct<C>, \
   sum2_wire<C>,   min_accumulate<C>, max_accumulate<C>}
#define FASTXFER_DEFINE_KERNELS(var, label) \
  const CompressKernels var = {             \
      label,                                \
      FASTXFER_WIRE_KERNELS(Bf16),          \
      FASTXFER_WIRE_KERNELS(Fp16),          \
      scale_f32,                            \
      accumulate_f32,                       \
      sum2_f32,                             \
  }

extern const CompressKernels kScalarKernels;
#if defined(FASTXFER_X86)
extern const CompressKernels kAvx2Kernels;        // AVX2 + F16C
extern const CompressKernels kAvx512Kernels;      // AVX-512 F/BW/VL/DQ
extern const CompressKernels kAvx512Bf16Kernels;  // plus AVX-512 BF16 (vcvtneps2bf16)
#endif

}  // namespace fastxfer
