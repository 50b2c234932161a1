// Public entry points of the compression kernels: SIMD level selection and multi-threaded
// calls that split one buffer across the thread pool. The engine and the bindings use these.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/kernels.h"

namespace fastxfer {

enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* simd_level_name(SimdLevel level);
SimdLevel simd_level_from_name(const std::string& name);  // throws std::invalid_argument
std::vector<SimdLevel> supported_simd_levels();             // ascending, scalar first
SimdLevel best_simd_level();
SimdLevel active_simd_level();
// Throws std::invalid_argument if this CPU cannot run `level`. fastxfer/__init__.py sets the level
// FASTXFER_SIMD asks for here at import (through _core.configure); the core reads no environment.
void set_simd_level(SimdLevel level);

const CompressKernels& active_kernels();

// Below this many elements per thread a buffer is not split (waking a thread costs ~10 us).
constexpr size_t kMinElementsPerThread = 256 * 1024;

// threads <= 0 means default_threads(). `wire` must be kBF16 or kFP16.
void compress(Compression wire, const float* src, uint16_t* dst, size_t n, float scale, int threads);
void decompress(Compression wire, const uint16_t* src, float* dst, size_t n, float scale, int threads);
void accumulate(Compression wire, float* acc, const uint16_t* src, size_t n, int threads);
void sum_compress(Compression wire, const uint16_t* a, const uint16_t* b, uint16_t* dst, size_t n, int threads);

// Runs the kernels of one call with the floating-point environment they are specified for:
// no flush-to-zero / denormals-are-zero (a TensorFlow thread may have set them; the results
// would then differ from the reference on subnormals). Restores the caller's setting.
// Sets or clears FTZ+DAZ on the calling thread, returning whether both were set before. For
// tests of ScopedIeeeFpEnv (what TensorFlow's threads do to MXCSR); a no-op off x86.
bool set_thread_flush_denormals(bool on);

class ScopedIeeeFpEnv {
 public:
  ScopedIeeeFpEnv();
  ~ScopedIeeeFpEnv();
  ScopedIeeeFpEnv(const ScopedIeeeFpEnv&) = delete;
  ScopedIeeeFpEnv& operator=(const ScopedIeeeFpEnv&) = delete;

 private:
  unsigned saved_ = 0;
};

}  // namespace fastxfer
