// The scalar path: the reference every SIMD path is tested against, and the path on CPUs
// (or architectures) without the vector extensions.
#include "compress/kernels.h"
#include "compress/loops_scalar.h"

namespace fastxfer {

namespace {
using namespace scalar_loops;
}  // namespace

const CompressKernels kScalarKernels = {
    "scalar",
    {compress<Bf16>, decompress<Bf16>, accumulate<Bf16>, sum_compress<Bf16>, sum2_direct<Bf16>},
    {compress<Fp16>, decompress<Fp16>, accumulate<Fp16>, sum_compress<Fp16>, sum2_direct<Fp16>},
    scale_f32,
    accumulate_f32,
    sum2_f32,
};

}  // namespace fastxfer
