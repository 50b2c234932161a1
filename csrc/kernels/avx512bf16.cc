// AVX-512 with the BF16 extension (Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later):
// float32 -> bf16 with one vcvtneps2bf16 per 16 values.
#define FASTXFER_NATIVE_BF16 1
#include "kernels/avx512_impl.h"

namespace fastxfer {
FASTXFER_DEFINE_KERNELS(kAvx512Bf16Kernels, "avx512bf16");
}  // namespace fastxfer
