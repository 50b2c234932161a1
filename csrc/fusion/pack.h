// Pack tensors into a bucket buffer (compressing and scaling on the way in) and unpack it back
// (decompressing and scaling on the way out): one pass over the data each way.
#pragma once
#include <vector>

#include "common/function_ref.h"
#include "fusion/bucket_planner.h"

namespace fastxfer {

// srcs[j] points at bucket.numels[j] elements of bucket.dtype; dst holds bucket.nbytes().
// Tensors are multiplied by `scale` (e.g. a pre-division factor) as Horovod scales them: float32
// and float64 in their own precision, integers in double truncated toward zero, float16 and
// bfloat16 in float32 rounded once; bool requires scale == 1 (std::invalid_argument otherwise).
// Padding is written as zeros.
void pack(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst, double scale, int threads);

// pack(bucket, srcs, dst, 1.0, 1) for a bucket whose packed form is its data as is (no compression,
// every dtype but bool), written with non-temporal stores and fenced before it returns: for a
// destination that another core reads next and this one does not (the one-exchange path's slot,
// collectives/shm_eager.cc). Regular stores would first take each line back from the reader's
// cache, which had it from two rounds ago (measured: docs/algorithms.md, "Small allreduces").
void pack_for_peers(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst);

// The inverse: dsts[j] receives bucket.numels[j] elements of bucket.dtype, multiplied by `scale`
// (e.g. 1/size to turn a sum into an average).
void unpack(const Bucket& bucket, const void* src, const std::vector<void*>& dsts, double scale, int threads);

// The same for the part [lo, hi) of the packed buffer (element offsets, padding included), so a
// transport can stream a bucket through a window smaller than the bucket. `dst`/`src` point at
// packed element `lo`. Tensor elements outside [lo, hi) are not touched.
void pack_range(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst, size_t lo, size_t hi,
                double scale, int threads);
void unpack_range(const Bucket& bucket, const void* src, const std::vector<void*>& dsts, size_t lo, size_t hi,
                  double scale, int threads);

// The pieces of tensors that fall inside packed range [lo, hi), in order (padding left out).
struct Segment {
  size_t tensor;   // index into the bucket's tensors
  size_t begin;    // first element of that tensor
  size_t packed;   // its packed offset
  size_t count;
};
std::vector<Segment> segments(const Bucket& bucket, size_t lo, size_t hi);
// The same pieces, handed to fn one by one (no vector: for the per-chunk paths of small buckets).
void for_each_segment(const Bucket& bucket, size_t lo, size_t hi, FunctionRef<void(const Segment&)> fn);

}  // namespace fastxfer
