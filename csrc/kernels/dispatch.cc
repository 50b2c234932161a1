// Run-time choice of the SIMD path, and the threaded wrappers around the kernels.
#include "kernels/compress.h"
#include "kernels/resample_kernels.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "common/parallel.h"
#include "common/cpu_features.h"

#if defined(FASTXFER_X86)
#include <xmmintrin.h>
#endif

namespace fastxfer {

namespace {

const CompressKernels* table_for(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return &kScalarKernels;
#if defined(FASTXFER_X86)
    case SimdLevel::kAvx2: return &kAvx2Kernels;
    case SimdLevel::kAvx512: return &kAvx512Kernels;
    case SimdLevel::kAvx512Bf16: return &kAvx512Bf16Kernels;
#else
    default: break;
#endif
  }
  return nullptr;
}

bool cpu_supports(SimdLevel level) {
  const CpuFeatures& f = cpu_features();
  switch (level) {
    case SimdLevel::kScalar: return true;
    case SimdLevel::kAvx2: return f.avx2 && f.f16c;
    case SimdLevel::kAvx512: return f.avx2 && f.f16c && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
    case SimdLevel::kAvx512Bf16:
      return cpu_supports(SimdLevel::kAvx512) && f.avx512_bf16;
  }
  return false;
}

std::atomic<const CompressKernels*>& active() {
  static std::atomic<const CompressKernels*> k{table_for(best_simd_level())};
  return k;
}

std::atomic<int>& active_level() {
  static std::atomic<int> l{static_cast<int>(best_simd_level())};
  return l;
}

const WireKernels& wire_kernels(Compression wire) {
  const CompressKernels& k = active_kernels();
  if (wire == Compression::kBF16) return k.bf16;
  if (wire == Compression::kFP16) return k.fp16;
  throw std::invalid_argument("compression must be 'bf16' or 'fp16' for a 16-bit kernel");
}

// Chunk boundaries on 64 elements: whole cache lines for both 2- and 4-byte elements.
constexpr size_t kAlign = 64;

}  // namespace

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kAvx512Bf16: return "avx512bf16";
  }
  return "?";
}

SimdLevel simd_level_from_name(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(SimdLevel::kAvx512Bf16); ++i) {
    auto l = static_cast<SimdLevel>(i);
    if (name == simd_level_name(l)) return l;
  }
  throw std::invalid_argument("unknown SIMD level '" + name +
                              "': expected one of scalar, avx2, avx512, avx512bf16");
}

std::vector<SimdLevel> supported_simd_levels() {
  std::vector<SimdLevel> out;
  for (int i = 0; i <= static_cast<int>(SimdLevel::kAvx512Bf16); ++i) {
    auto l = static_cast<SimdLevel>(i);
    if (table_for(l) && cpu_supports(l)) out.push_back(l);
  }
  return out;
}

SimdLevel best_simd_level() { return supported_simd_levels().back(); }

SimdLevel active_simd_level() { return static_cast<SimdLevel>(active_level().load()); }

void set_simd_level(SimdLevel level) {
  if (!table_for(level) || !cpu_supports(level)) {
    std::string have;
    for (SimdLevel l : supported_simd_levels()) have += std::string(have.empty() ? "" : ", ") + simd_level_name(l);
    throw std::invalid_argument(std::string("SIMD level '") + simd_level_name(level) +
                                "' is not supported on this CPU (supported: " + have + ")");
  }
  active().store(table_for(level));
  active_level().store(static_cast<int>(level));
}

const CompressKernels& active_kernels() { return *active().load(); }

const ResampleKernels& resample_kernels() {
#if defined(FASTXFER_X86)
  if (active_simd_level() >= SimdLevel::kAvx512) return kAvx512Resample;
#endif
  return kPortableResample;
}

namespace {
thread_local bool t_stream_stores = false;
}  // namespace

bool stream_stores() { return t_stream_stores; }
ScopedStreamStores::ScopedStreamStores(bool on) : saved_(t_stream_stores) { t_stream_stores = on; }
ScopedStreamStores::~ScopedStreamStores() { t_stream_stores = saved_; }

bool set_thread_flush_denormals(bool on) {
#if defined(FASTXFER_X86)
  unsigned csr = _mm_getcsr();
  bool was = (csr & 0x8040u) == 0x8040u;
  _mm_setcsr(on ? (csr | 0x8040u) : (csr & ~0x8040u));
  return was;
#else
  (void)on;
  return false;
#endif
}

ScopedIeeeFpEnv::ScopedIeeeFpEnv() {
#if defined(FASTXFER_X86)
  saved_ = _mm_getcsr();
  unsigned want = saved_ & ~(0x8000u | 0x0040u);  // clear FTZ and DAZ
  if (want != saved_) _mm_setcsr(want);
#endif
}

ScopedIeeeFpEnv::~ScopedIeeeFpEnv() {
#if defined(FASTXFER_X86)
  if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
#endif
}

void compress(Compression wire, const float* src, uint16_t* dst, size_t n, float scale, int threads) {
  auto fn = wire_kernels(wire).compress;
  parallel_for(n, threads, kMinElementsPerThread, kAlign, [&](size_t b, size_t e) {
    ScopedIeeeFpEnv env;
    fn(src + b, dst + b, e - b, scale);
  });
}

void decompress(Compression wire, const uint16_t* src, float* dst, size_t n, float scale, int threads) {
  auto fn = wire_kernels(wire).decompress;
  parallel_for(n, threads, kMinElementsPerThread, kAlign, [&](size_t b, size_t e) {
    ScopedIeeeFpEnv env;
    fn(src + b, dst + b, e - b, scale);
  });
}

void accumulate(Compression wire, float* acc, const uint16_t* src, size_t n, int threads) {
  auto fn = wire_kernels(wire).accumulate;
  parallel_for(n, threads, kMinElementsPerThread, kAlign, [&](size_t b, size_t e) {
    ScopedIeeeFpEnv env;
    fn(acc + b, src + b, e - b);
  });
}

void sum_compress(Compression wire, const uint16_t* a, const uint16_t* b, uint16_t* dst, size_t n, int threads) {
  auto fn = wire_kernels(wire).sum_compress;
  parallel_for(n, threads, kMinElementsPerThread, kAlign, [&](size_t lo, size_t hi) {
    ScopedIeeeFpEnv env;
    fn(a + lo, b + lo, dst + lo, hi - lo);
  });
}

}  // namespace fastxfer
