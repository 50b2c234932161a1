// Pack/unpack. Work is split across threads by packed elements, not by tensors, so one huge
// tensor next to many tiny ones still spreads evenly: a thread handling packed elements [b, e)
// finds the tensors that overlap it by binary search over the (ascending) offsets.
#include "fusion/pack.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "common/parallel.h"
#include "kernels/compress.h"
#include "kernels/reduce.h"

namespace fastxfer {

namespace {

void check_scale(const Bucket& b, double scale) {
  if (scale != 1.0 && b.dtype == DType::kBool) throw std::invalid_argument("bool buckets cannot be scaled");
}

void check_count(const Bucket& b, size_t n, const char* what) {
  if (n != b.tensors.size())
    throw std::invalid_argument(std::string(what) + ": got " + std::to_string(n) + " tensors for a bucket of " +
                                std::to_string(b.tensors.size()));
}

void check_range(const Bucket& b, size_t lo, size_t hi) {
  if (lo > hi || hi > b.numel)
    throw std::invalid_argument("range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                ") is outside the bucket of " + std::to_string(b.numel) + " elements");
}

// Calls seg(j, t_begin, t_end, p_begin) for every piece of tensor j inside packed range [lo, hi)
// (t_* in the tensor's elements, p_begin in packed elements), and gap(p_begin, p_end) for padding.
template <class Seg, class Gap>
void walk(const Bucket& b, size_t lo, size_t hi, Seg&& seg, Gap&& gap) {
  const auto& off = b.offsets;
  // first tensor that ends after lo
  size_t j = std::upper_bound(off.begin(), off.end(), lo) - off.begin();
  if (j > 0) --j;
  size_t pos = lo;
  for (; j < off.size() && pos < hi; ++j) {
    size_t t0 = off[j], t1 = off[j] + b.numels[j];
    if (t1 <= pos) continue;
    if (t0 >= hi) break;
    if (t0 > pos) gap(pos, t0);
    size_t s = std::max(pos, t0), e = std::min(hi, t1);
    if (s < e) seg(j, s - t0, e - t0, s);
    pos = e;
  }
  if (pos < hi) gap(pos, hi);
}

}  // namespace

void pack_range(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst, size_t lo, size_t hi,
                double scale, int threads) {
  check_count(bucket, srcs.size(), "pack");
  check_scale(bucket, scale);
  check_range(bucket, lo, hi);
  const size_t esize = dtype_size(bucket.dtype), wsize = dtype_size(bucket.wire_dtype);
  const CompressKernels& k = active_kernels();
  char* out = static_cast<char*>(dst);
  const float f = static_cast<float>(scale);
  parallel_for(hi - lo, threads, kMinElementsPerThread, 64, [&](size_t a, size_t z) {
    ScopedIeeeFpEnv env;
    walk(
        bucket, lo + a, lo + z,
        [&](size_t j, size_t b, size_t e, size_t p) {
          const char* src = static_cast<const char*>(srcs[j]) + b * esize;
          char* d = out + (p - lo) * wsize;
          size_t n = e - b;
          if (bucket.dtype == DType::kFloat32) {
            const float* s = reinterpret_cast<const float*>(src);
            switch (bucket.compression) {
              case Compression::kBF16: k.bf16.compress(s, reinterpret_cast<uint16_t*>(d), n, f); break;
              case Compression::kFP16: k.fp16.compress(s, reinterpret_cast<uint16_t*>(d), n, f); break;
              case Compression::kNone: k.scale_f32(s, reinterpret_cast<float*>(d), n, f); break;
            }
          } else if (scale != 1.0) {
            // Horovod's ScaleBuffer: float64 in double; integers in double, truncated toward
            // zero; float16/bfloat16 in float32, rounded once (kernels/reduce.h)
            reduce_block(ReduceOp::kSum, bucket.dtype, reinterpret_cast<const void* const*>(&src), 1, d, n, scale);
          } else {
            std::memcpy(d, src, n * esize);
          }
        },
        [&](size_t p0, size_t p1) { std::memset(out + (p0 - lo) * wsize, 0, (p1 - p0) * wsize); });
  });
}

void unpack_range(const Bucket& bucket, const void* src, const std::vector<void*>& dsts, size_t lo, size_t hi,
                  double scale, int threads) {
  check_count(bucket, dsts.size(), "unpack");
  check_scale(bucket, scale);
  check_range(bucket, lo, hi);
  const size_t esize = dtype_size(bucket.dtype), wsize = dtype_size(bucket.wire_dtype);
  const CompressKernels& k = active_kernels();
  const char* in = static_cast<const char*>(src);
  const float f = static_cast<float>(scale);
  parallel_for(hi - lo, threads, kMinElementsPerThread, 64, [&](size_t a, size_t z) {
    ScopedIeeeFpEnv env;
    walk(
        bucket, lo + a, lo + z,
        [&](size_t j, size_t b, size_t e, size_t p) {
          const char* s = in + (p - lo) * wsize;
          char* d = static_cast<char*>(dsts[j]) + b * esize;
          size_t n = e - b;
          if (bucket.dtype == DType::kFloat32) {
            float* o = reinterpret_cast<float*>(d);
            switch (bucket.compression) {
              case Compression::kBF16: k.bf16.decompress(reinterpret_cast<const uint16_t*>(s), o, n, f); break;
              case Compression::kFP16: k.fp16.decompress(reinterpret_cast<const uint16_t*>(s), o, n, f); break;
              case Compression::kNone: k.scale_f32(reinterpret_cast<const float*>(s), o, n, f); break;
            }
          } else if (scale != 1.0) {
            reduce_block(ReduceOp::kSum, bucket.dtype, reinterpret_cast<const void* const*>(&s), 1, d, n, scale);
          } else {
            std::memcpy(d, s, n * esize);
          }
        },
        [](size_t, size_t) {});
  });
}

void for_each_segment(const Bucket& bucket, size_t lo, size_t hi, FunctionRef<void(const Segment&)> fn) {
  check_range(bucket, lo, hi);
  walk(
      bucket, lo, hi, [&](size_t j, size_t b, size_t e, size_t p) { fn(Segment{j, b, p, e - b}); },
      [](size_t, size_t) {});
}

std::vector<Segment> segments(const Bucket& bucket, size_t lo, size_t hi) {
  std::vector<Segment> out;
  for_each_segment(bucket, lo, hi, [&](const Segment& s) { out.push_back(s); });
  return out;
}

void pack(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst, double scale, int threads) {
  pack_range(bucket, srcs, dst, 0, bucket.numel, scale, threads);
}

namespace {

// dst[0, n) = src[0, n) with 16-byte non-temporal stores (SSE2: every x86-64 has them) wherever dst
// is 16-byte aligned; the unaligned head and the tail as usual.
void copy_non_temporal(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 16 <= n; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace

void pack_for_peers(const Bucket& bucket, const std::vector<const void*>& srcs, void* dst) {
  check_count(bucket, srcs.size(), "pack");
  if (bucket.dtype != bucket.wire_dtype || bucket.dtype == DType::kBool)
    throw std::invalid_argument("pack_for_peers takes an uncompressed bucket of a numeric dtype");
  const size_t es = dtype_size(bucket.dtype);
  char* out = static_cast<char*>(dst);
  walk(
      bucket, 0, bucket.numel,
      [&](size_t j, size_t b, size_t e, size_t p) {
        copy_non_temporal(out + p * es, static_cast<const char*>(srcs[j]) + b * es, (e - b) * es);
      },
      [&](size_t p0, size_t p1) { std::memset(out + p0 * es, 0, (p1 - p0) * es); });
#if defined(__x86_64__)
  _mm_sfence();  // non-temporal stores are not ordered by the release that publishes them
#endif
}

void unpack(const Bucket& bucket, const void* src, const std::vector<void*>& dsts, double scale, int threads) {
  unpack_range(bucket, src, dsts, 0, bucket.numel, scale, threads);
}

}  // namespace fastxfer
