// The scalar path: the reference every SIMD path is tested against, and the path on CPUs
// (or architectures) without the vector extensions.
#include "kernels/kernels.h"
#include "kernels/loops_scalar.h"

namespace fastxfer {

namespace {
using namespace scalar_loops;
}  // namespace

FASTXFER_DEFINE_KERNELS(kScalarKernels, "scalar");

}  // namespace fastxfer
