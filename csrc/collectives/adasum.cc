// Adasum (collectives/adasum.h): the pairwise rule, the tree over the ranks, and the fused
// allreduce that gathers every rank's bucket and combines it locally.
#include "collectives/adasum.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/parallel.h"
#include "fusion/pack.h"
#include "kernels/compress.h"

namespace fastxfer {

namespace {

// Dot products are summed over fixed blocks of this many elements, then block by block in
// order: the same bits whatever the number of threads.
constexpr size_t kDotBlock = 4096;
// Horovod's threshold: a vector whose squared norm is below it keeps coefficient 1.
constexpr double kNormFloor = 1e-8;

// a <- adasum(a, b), both `count` doubles.
void pair(double* a, const double* b, size_t count, int threads, std::vector<double>& partial) {
  const size_t blocks = (count + kDotBlock - 1) / kDotBlock;
  partial.assign(3 * blocks, 0.0);
  parallel_for(blocks, threads, 16, 1, [&](size_t lo, size_t hi) {
    for (size_t k = lo; k < hi; ++k) {
      double dot = 0, an = 0, bn = 0;
      const size_t e = std::min(count, (k + 1) * kDotBlock);
      for (size_t i = k * kDotBlock; i < e; ++i) {
        dot += a[i] * b[i];
        an += a[i] * a[i];
        bn += b[i] * b[i];
      }
      partial[3 * k] = dot;
      partial[3 * k + 1] = an;
      partial[3 * k + 2] = bn;
    }
  });
  double dot = 0, an = 0, bn = 0;
  for (size_t k = 0; k < blocks; ++k) {
    dot += partial[3 * k];
    an += partial[3 * k + 1];
    bn += partial[3 * k + 2];
  }
  const double ca = an >= kNormFloor ? 1.0 - dot / an * 0.5 : 1.0;
  const double cb = bn >= kNormFloor ? 1.0 - dot / bn * 0.5 : 1.0;
  parallel_for(count, threads, kMinElementsPerThread, 8, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) a[i] = ca * a[i] + cb * b[i];
  });
}

// `count` elements of `wire` at `src` -> doubles.
void decode(DType wire, const char* src, double* dst, size_t count, std::vector<float>& tmp) {
  switch (wire) {
    case DType::kFloat64: std::memcpy(dst, src, count * sizeof(double)); return;
    case DType::kFloat32: {
      const float* s = reinterpret_cast<const float*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = s[i];
      return;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      const CompressKernels& k = active_kernels();
      tmp.resize(count);
      (wire == DType::kFloat16 ? k.fp16 : k.bf16).decompress(reinterpret_cast<const uint16_t*>(src), tmp.data(), count,
                                                            1.0f);
      for (size_t i = 0; i < count; ++i) dst[i] = tmp[i];
      return;
    }
    default: throw std::invalid_argument(std::string("op adasum needs floating-point data, not ") + dtype_name(wire));
  }
}

// doubles * scale -> `count` elements of `wire` at `dst`, rounded once (16-bit: to nearest even
// from the float32 nearest to the double, as Horovod's fp16 path rounds through float32).
void encode(DType wire, const double* src, char* dst, size_t count, double scale, std::vector<float>& tmp) {
  switch (wire) {
    case DType::kFloat64: {
      double* d = reinterpret_cast<double*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = src[i] * scale;
      return;
    }
    case DType::kFloat32: {
      float* d = reinterpret_cast<float*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = static_cast<float>(src[i] * scale);
      return;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      const CompressKernels& k = active_kernels();
      tmp.resize(count);
      for (size_t i = 0; i < count; ++i) tmp[i] = static_cast<float>(src[i] * scale);
      (wire == DType::kFloat16 ? k.fp16 : k.bf16).compress(tmp.data(), reinterpret_cast<uint16_t*>(dst), count, 1.0f);
      return;
    }
    default: throw std::invalid_argument(std::string("op adasum needs floating-point data, not ") + dtype_name(wire));
  }
}

}  // namespace

void adasum_combine(const std::vector<double*>& vs, size_t count, int threads) {
  const size_t n = vs.size();
  if (n < 2) return;
  size_t p = 1;
  while (p * 2 <= n) p *= 2;
  std::vector<double> partial;
  for (size_t r = p; r < n; ++r) pair(vs[r - p], vs[r], count, threads, partial);  // fold the ranks past 2^k
  for (size_t level = 1; level < p; level *= 2)
    for (size_t r = 0; r + level < p; r += 2 * level) pair(vs[r], vs[r + level], count, threads, partial);
}

void adasum_allreduce(Collectives& comm, const AllreduceJob& job, int threads) {
  const Bucket& b = *job.bucket;
  const size_t n = static_cast<size_t>(comm.size());
  const size_t ws = dtype_size(b.wire_dtype), bytes = b.nbytes();
  if (b.wire_dtype != DType::kFloat32 && b.wire_dtype != DType::kFloat64 && b.wire_dtype != DType::kFloat16 &&
      b.wire_dtype != DType::kBFloat16)
    throw std::invalid_argument(std::string("op adasum needs floating-point data, not ") + dtype_name(b.dtype));
  std::vector<char> mine(bytes), all(n * bytes), result(bytes, 0);
  pack(b, job.srcs, mine.data(), job.prescale, threads);
  comm.allgather(mine.data(), all.data(), std::vector<size_t>(n, bytes));
  ScopedIeeeFpEnv env;
  std::vector<double> v;
  std::vector<double*> vs(n);
  std::vector<float> tmp;
  for (size_t t = 0; t < b.tensors.size(); ++t) {
    const size_t off = b.offsets[t], count = b.numels[t];
    if (count == 0) continue;
    v.resize(n * count);
    for (size_t j = 0; j < n; ++j) {
      vs[j] = v.data() + j * count;
      decode(b.wire_dtype, all.data() + j * bytes + off * ws, vs[j], count, tmp);
    }
    adasum_combine(vs, count, threads);
    encode(b.wire_dtype, vs[0], result.data() + off * ws, count, job.postscale, tmp);
  }
  unpack(b, result.data(), job.outs, 1.0, threads);
}

}  // namespace fastxfer
