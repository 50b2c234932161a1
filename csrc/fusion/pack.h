// Pack tensors into a bucket buffer (compressing and scaling on the way in) and unpack it back
// (decompressing and scaling on the way out): one pass over the data each way.
#pragma once
#include <vector>

#include "fusion/bucket_planner.h"

namespace fastxfer {

// srcs[j] points at bucket.numels[j] elements of bucket.dtype; dst holds bucket.nbytes().
// float32 and float64 tensors are multiplied by `scale` (e.g. a pre-division factor); other
// dtypes require scale == 1 (std::invalid_argument otherwise). Padding is written as zeros.
void pack(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst, double scale, int threads);

// The inverse: dsts[j] receives bucket.numels[j] elements of bucket.dtype, multiplied by `scale`
// (e.g. 1/size to turn a sum into an average).
void unpack(const Bucket& bucket, const void* src, const std::vector<void*>& dsts, double scale, int threads);

}  // namespace fastxfer
