// The resampler's two inner loops (data/resample.cc), one table per SIMD level, chosen by the
// same run-time dispatch as the compression kernels (kernels/dispatch.cc).
#pragma once
#include <cstddef>
#include <cstdint>

namespace fastxfer {

struct ResampleKernels {
  const char* name;
  // acc[j] = sum_k w[k] * rows[k][j] for j < len (rows are bytes), summed in order k = 0, 1, ...
  void (*vertical)(float* acc, const uint8_t* const* rows, const float* w, int n, size_t len);
  // One output row of ow RGB pixels from the vertically filtered RGBX row `acc`: horizontal taps
  // in blocks of four (fx: each pixel's first tap, w16: weights), brightness, clamp to [0, 255],
  // then, when `normalise`, v * sc - off; mirrored when `flip`. bright/sc/off hold 4 lanes.
  void (*row)(float* dst, const float* acc, const int32_t* fx, const float* w16, int blocks, int ow, bool flip,
              const float* bright, const float* sc, const float* off, bool normalise);
};

extern const ResampleKernels kPortableResample;
#if defined(FASTXFER_X86)
extern const ResampleKernels kAvx512Resample;  // AVX-512 F/BW/VL/DQ with FMA
#endif

// The table for the active SIMD level (FASTXFER_SIMD and fx tests' level switch apply here too).
const ResampleKernels& resample_kernels();

}  // namespace fastxfer
