// What the CPU (and the OS, which must save the wide registers) lets us run.
#pragma once

namespace fastxfer {

struct CpuFeatures {
  bool avx2 = false;
  bool f16c = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_bf16 = false;
  bool amx_tile = false;
};

// Probed once (cpuid + xgetbv on x86; all false elsewhere).
const CpuFeatures& cpu_features();

}  // namespace fastxfer
