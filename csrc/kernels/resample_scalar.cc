// The portable resampling table (4-lane GCC vectors, no ISA flags).
#include "kernels/resample_kernels.h"
#include "kernels/resample_portable.h"

namespace fastxfer {

namespace {

void vertical_portable(float* acc, const uint8_t* const* rows, const float* w, int n, size_t len) {
  vertical_body(acc, rows, w, n, len);
}

void row_portable_fn(float* dst, const float* acc, const int32_t* fx, const float* w16, int blocks, int ow, bool flip,
                     const float* bright, const float* sc, const float* off, bool normalise) {
  row_portable(dst, acc, fx, w16, blocks, 0, ow, flip, lanes(bright), lanes(sc), lanes(off), normalise);
}

}  // namespace

const ResampleKernels kPortableResample = {"portable", vertical_portable, row_portable_fn};

}  // namespace fastxfer
