// cpuid/xgetbv probe. A feature counts only if the OS enabled its register state in XCR0:
// a hypervisor can report AVX-512 in cpuid while not saving zmm registers.
#include "common/cpu_features.h"

#if defined(FASTXFER_X86)
#include <cpuid.h>
#include <cstdint>
#endif

namespace fastxfer {

namespace {

CpuFeatures probe() {
  CpuFeatures f;
#if defined(FASTXFER_X86)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = c & (1u << 27);
  bool avx = c & (1u << 28);
  bool f16c = c & (1u << 29);
  bool fma = c & (1u << 12);
  if (!osxsave || !avx) return f;
  uint32_t xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  uint64_t xcr0 = (static_cast<uint64_t>(xhi) << 32) | xlo;
  bool ymm_ok = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  bool zmm_ok = (xcr0 & 0xe6) == 0xe6;   // plus opmask, ZMM_Hi256, Hi16_ZMM
  bool amx_ok = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
  if (!ymm_ok) return f;
  f.f16c = f16c;
  f.fma = fma;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = b & (1u << 5);
  if (zmm_ok) {
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_fp16 = d & (1u << 23);
  }
  if (amx_ok) {
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
  }
  unsigned a1, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  if (zmm_ok) f.avx512_bf16 = a1 & (1u << 5);
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe();
  return features;
}

}  // namespace fastxfer
