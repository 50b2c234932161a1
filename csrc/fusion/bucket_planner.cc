// Bucket planning: greedy in gradient-ready order, one open bucket per dtype.
#include "fusion/bucket_planner.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace fastxfer {

BucketPlanner::BucketPlanner(size_t cap_bytes, size_t first_cap_bytes, Compression compression)
    : cap_bytes_(cap_bytes), first_cap_bytes_(first_cap_bytes), compression_(compression) {
  if (cap_bytes_ == 0) throw std::invalid_argument("bucket cap must be at least 1 byte");
  if (first_cap_bytes_ == 0) throw std::invalid_argument("first bucket cap must be at least 1 byte");
  // A first bucket larger than the cap makes no sense; treat it as the cap.
  first_cap_bytes_ = std::min(first_cap_bytes_, cap_bytes_);
}

std::vector<Bucket> BucketPlanner::plan(const std::vector<TensorSpec>& tensors) const {
  std::vector<Bucket> done;
  std::map<DType, Bucket> open;  // std::map: iteration order is fixed, not hash-dependent

  auto cap = [&] { return done.empty() ? first_cap_bytes_ : cap_bytes_; };
  auto close = [&](DType t) {
    auto it = open.find(t);
    if (it == open.end()) return;
    done.push_back(std::move(it->second));
    open.erase(it);
  };

  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& spec = tensors[i];
    DType wire = wire_dtype(spec.dtype, compression_);
    size_t esize = dtype_size(wire);
    size_t align = kBucketAlignBytes / esize;

    auto it = open.find(spec.dtype);
    if (it != open.end()) {
      const Bucket& b = it->second;
      size_t offset = (b.numel + align - 1) / align * align;
      if ((offset + spec.numel) * esize > cap()) {
        close(spec.dtype);
        it = open.end();
      }
    }
    if (it == open.end()) {
      Bucket b;
      b.dtype = spec.dtype;
      b.compression = spec.dtype == DType::kFloat32 ? compression_ : Compression::kNone;
      b.wire_dtype = wire;
      it = open.emplace(spec.dtype, std::move(b)).first;
    }
    Bucket& b = it->second;
    size_t offset = (b.numel + align - 1) / align * align;
    b.tensors.push_back(static_cast<int>(i));
    b.offsets.push_back(offset);
    b.numels.push_back(spec.numel);
    b.numel = offset + spec.numel;
    // Full (or a single oversized tensor): close now so it can be reduced while the rest arrive.
    if (b.numel * esize >= cap()) close(spec.dtype);
  }
  // Remaining open buckets, in the order of their last tensor.
  std::vector<Bucket> rest;
  for (auto& kv : open) rest.push_back(std::move(kv.second));
  std::sort(rest.begin(), rest.end(),
            [](const Bucket& a, const Bucket& b) { return a.tensors.back() < b.tensors.back(); });
  for (auto& b : rest) done.push_back(std::move(b));
  // Completion order: a bucket is complete when its last tensor is ready.
  std::stable_sort(done.begin(), done.end(),
                   [](const Bucket& a, const Bucket& b) { return a.tensors.back() < b.tensors.back(); });
  return done;
}

void BucketPlanner::plan_into(const std::vector<TensorSpec>& tensors, std::vector<Bucket>& out) const {
  for (const TensorSpec& t : tensors) {
    if (t.dtype != tensors[0].dtype) {
      out = plan(tensors);
      return;
    }
  }
  // One dtype: plan() with a single open bucket, closed in order, so completion order is the
  // order of closing.
  size_t used = 0;
  if (!tensors.empty()) {
    const DType dtype = tensors[0].dtype;
    const DType wire = wire_dtype(dtype, compression_);
    const size_t esize = dtype_size(wire), align = kBucketAlignBytes / esize;
    Bucket* open = nullptr;
    auto start = [&]() -> Bucket* {
      if (used == out.size()) out.emplace_back();
      Bucket& b = out[used++];
      b.dtype = dtype;
      b.compression = dtype == DType::kFloat32 ? compression_ : Compression::kNone;
      b.wire_dtype = wire;
      b.tensors.clear();
      b.offsets.clear();
      b.numels.clear();
      b.numel = 0;
      return &b;
    };
    // The cap of the open bucket: the first one closed is bucket 0.
    auto cap = [&] { return used <= 1 ? first_cap_bytes_ : cap_bytes_; };
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t n = tensors[i].numel;
      if (open != nullptr && ((open->numel + align - 1) / align * align + n) * esize > cap()) open = nullptr;
      if (open == nullptr) open = start();
      const size_t offset = (open->numel + align - 1) / align * align;
      open->tensors.push_back(static_cast<int>(i));
      open->offsets.push_back(offset);
      open->numels.push_back(n);
      open->numel = offset + n;
      if (open->numel * esize >= cap()) open = nullptr;
    }
  }
  out.resize(used);
}

}  // namespace fastxfer
