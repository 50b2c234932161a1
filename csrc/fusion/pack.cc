// Pack/unpack. Work is split across threads by elements, not by tensors, so one huge tensor
// next to many tiny ones still spreads evenly: thread t handles elements [b, e) of the
// concatenation of all tensors and finds its tensors by binary search.
#include "fusion/pack.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/parallel.h"
#include "compress/compress.h"

namespace fastxfer {

namespace {

void check_scale(const Bucket& b, double scale) {
  if (scale != 1.0 && b.dtype != DType::kFloat32 && b.dtype != DType::kFloat64)
    throw std::invalid_argument(std::string("scale != 1 is only supported for float32 and float64 buckets, not ") +
                                dtype_name(b.dtype));
}

// Calls fn(j, begin, end) for each piece [begin, end) of tensor j inside element range [lo, hi)
// of the concatenated tensors. `starts` holds prefix sums of the tensor sizes.
template <class Fn>
void for_segments(const std::vector<size_t>& starts, size_t lo, size_t hi, Fn&& fn) {
  size_t j = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
  for (; j + 1 < starts.size() && starts[j] < hi; ++j) {
    size_t b = std::max(lo, starts[j]), e = std::min(hi, starts[j + 1]);
    if (b < e) fn(j, b - starts[j], e - starts[j]);
  }
}

std::vector<size_t> prefix(const Bucket& b) {
  std::vector<size_t> s(b.numels.size() + 1, 0);
  for (size_t j = 0; j < b.numels.size(); ++j) s[j + 1] = s[j] + b.numels[j];
  return s;
}

void zero_padding(const Bucket& b, void* dst) {
  size_t esize = dtype_size(b.wire_dtype);
  char* p = static_cast<char*>(dst);
  size_t end = 0;
  for (size_t j = 0; j < b.offsets.size(); ++j) {
    if (b.offsets[j] > end) std::memset(p + end * esize, 0, (b.offsets[j] - end) * esize);
    end = b.offsets[j] + b.numels[j];
  }
}

}  // namespace

void pack(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst, double scale, int threads) {
  if (srcs.size() != bucket.tensors.size())
    throw std::invalid_argument("pack: got " + std::to_string(srcs.size()) + " tensors for a bucket of " +
                                std::to_string(bucket.tensors.size()));
  check_scale(bucket, scale);
  zero_padding(bucket, dst);
  const std::vector<size_t> starts = prefix(bucket);
  const size_t esize = dtype_size(bucket.dtype), wsize = dtype_size(bucket.wire_dtype);
  const CompressKernels& k = active_kernels();
  char* out = static_cast<char*>(dst);
  parallel_for(starts.back(), threads, kMinElementsPerThread, 64, [&](size_t lo, size_t hi) {
    ScopedIeeeFpEnv env;
    for_segments(starts, lo, hi, [&](size_t j, size_t b, size_t e) {
      const char* src = static_cast<const char*>(srcs[j]) + b * esize;
      char* d = out + (bucket.offsets[j] + b) * wsize;
      size_t n = e - b;
      if (bucket.dtype == DType::kFloat32) {
        const float* s = reinterpret_cast<const float*>(src);
        float f = static_cast<float>(scale);
        switch (bucket.compression) {
          case Compression::kBF16: k.bf16.compress(s, reinterpret_cast<uint16_t*>(d), n, f); break;
          case Compression::kFP16: k.fp16.compress(s, reinterpret_cast<uint16_t*>(d), n, f); break;
          case Compression::kNone: k.scale_f32(s, reinterpret_cast<float*>(d), n, f); break;
        }
      } else if (bucket.dtype == DType::kFloat64 && scale != 1.0) {
        const double* s = reinterpret_cast<const double*>(src);
        double* o = reinterpret_cast<double*>(d);
        for (size_t i = 0; i < n; ++i) o[i] = s[i] * scale;
      } else {
        std::memcpy(d, src, n * esize);
      }
    });
  });
}

void unpack(const Bucket& bucket, const void* src, const std::vector<void*>& dsts, double scale, int threads) {
  if (dsts.size() != bucket.tensors.size())
    throw std::invalid_argument("unpack: got " + std::to_string(dsts.size()) + " outputs for a bucket of " +
                                std::to_string(bucket.tensors.size()));
  check_scale(bucket, scale);
  const std::vector<size_t> starts = prefix(bucket);
  const size_t esize = dtype_size(bucket.dtype), wsize = dtype_size(bucket.wire_dtype);
  const CompressKernels& k = active_kernels();
  const char* in = static_cast<const char*>(src);
  parallel_for(starts.back(), threads, kMinElementsPerThread, 64, [&](size_t lo, size_t hi) {
    ScopedIeeeFpEnv env;
    for_segments(starts, lo, hi, [&](size_t j, size_t b, size_t e) {
      const char* s = in + (bucket.offsets[j] + b) * wsize;
      char* d = static_cast<char*>(dsts[j]) + b * esize;
      size_t n = e - b;
      if (bucket.dtype == DType::kFloat32) {
        float* o = reinterpret_cast<float*>(d);
        float f = static_cast<float>(scale);
        switch (bucket.compression) {
          case Compression::kBF16: k.bf16.decompress(reinterpret_cast<const uint16_t*>(s), o, n, f); break;
          case Compression::kFP16: k.fp16.decompress(reinterpret_cast<const uint16_t*>(s), o, n, f); break;
          case Compression::kNone: k.scale_f32(reinterpret_cast<const float*>(s), o, n, f); break;
        }
      } else if (bucket.dtype == DType::kFloat64 && scale != 1.0) {
        const double* p = reinterpret_cast<const double*>(s);
        double* o = reinterpret_cast<double*>(d);
        for (size_t i = 0; i < n; ++i) o[i] = p[i] * scale;
      } else {
        std::memcpy(d, s, n * esize);
      }
    });
  });
}

}  // namespace fastxfer
