// AVX-512 F/BW/VL/DQ path (Skylake-SP and later; AMD Zen 4 and later).
#define FASTXFER_NATIVE_BF16 0
#include "kernels/avx512_impl.h"

namespace fastxfer {
FASTXFER_DEFINE_KERNELS(kAvx512Kernels, "avx512");
}  // namespace fastxfer
