// Groups gradient tensors, in the order they become ready, into fused buckets under a byte cap.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"

namespace fastxfer {

struct TensorSpec {
  size_t numel;
  DType dtype;
};

// One fused bucket: tensors of a single dtype laid out back to back, each starting on a 64-byte
// boundary (so threads packing neighbouring tensors never share a cache line). Padding is zero.
struct Bucket {
  DType dtype;                 // dtype of every tensor in the bucket
  Compression compression;     // how float32 tensors travel (kNone for other dtypes)
  DType wire_dtype;            // element type of the packed buffer
  std::vector<int> tensors;    // indices into the planner's input, ascending
  std::vector<size_t> offsets; // element offset of each tensor in the packed buffer
  std::vector<size_t> numels;  // element count of each tensor
  size_t numel = 0;            // elements in the packed buffer, padding included
  size_t nbytes() const { return numel * dtype_size(wire_dtype); }
};

constexpr size_t kBucketAlignBytes = 64;
constexpr size_t kDefaultBucketCapBytes = 25u << 20;      // 25 MiB, as PyTorch DDP
constexpr size_t kDefaultFirstBucketCapBytes = 1u << 20;  // small first bucket: start talking early

class BucketPlanner {
 public:
  // Caps count bytes on the wire (after compression). Throws std::invalid_argument on a zero cap.
  BucketPlanner(size_t cap_bytes = kDefaultBucketCapBytes,
                size_t first_cap_bytes = kDefaultFirstBucketCapBytes,
                Compression compression = Compression::kNone);

  // Deterministic in its input alone, so every rank that sees the same tensor list plans the
  // same buckets. Each dtype has one open bucket; a tensor joins the open bucket of its dtype
  // unless that would pass the cap, in which case the open bucket is closed first. A tensor
  // larger than the cap gets a bucket of its own. The first bucket closed uses first_cap_bytes.
  // Buckets are returned in the order they become complete (by their last tensor), which is
  // the order the engine can start reducing them.
  std::vector<Bucket> plan(const std::vector<TensorSpec>& tensors) const;
  // The same plan, written into `out` (resized to the plan's buckets). When every tensor has one
  // dtype (the engine's fused runs: they fuse only tensors of one dtype) the buckets already in
  // `out` keep their storage, so a caller that plans the same shapes again allocates nothing.
  void plan_into(const std::vector<TensorSpec>& tensors, std::vector<Bucket>& out) const;

  size_t cap_bytes() const { return cap_bytes_; }
  size_t first_cap_bytes() const { return first_cap_bytes_; }
  Compression compression() const { return compression_; }

 private:
  size_t cap_bytes_;
  size_t first_cap_bytes_;
  Compression compression_;
};

}  // namespace fastxfer
