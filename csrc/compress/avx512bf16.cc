// AVX-512 with the BF16 extension (Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later):
// float32 -> bf16 with one vcvtneps2bf16 per 16 values.
#define FASTXFER_NATIVE_BF16 1
#include "compress/avx512_impl.h"

namespace fastxfer {
const CompressKernels kAvx512Bf16Kernels = {
    "avx512bf16",
    {compress<Bf16>, decompress<Bf16>, accumulate<Bf16>, sum_compress<Bf16>, sum2_direct<Bf16>},
    {compress<Fp16>, decompress<Fp16>, accumulate<Fp16>, sum_compress<Fp16>, sum2_direct<Fp16>},
    scale_f32,
    accumulate_f32,
    sum2_f32,
};
}  // namespace fastxfer
