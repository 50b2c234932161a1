// Adasum (collectives/adasum.h): the pairwise rule, the tree over the ranks, and the fused
// allreduce that gathers every rank's bucket and combines it locally.
#include "collectives/adasum.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <memory>
#include <string>

#include "common/parallel.h"
#include "fusion/pack.h"
#include "kernels/compress.h"

namespace fastxfer {

namespace {

// Dot products are summed over fixed blocks of this many elements, then block by block in
// order: the same bits whatever the number of threads. A block of each operand, decoded to
// float64, stays in L1/L2 while it is used.
constexpr size_t kBlock = 4096;
// Horovod's threshold: a vector whose squared norm is below it keeps coefficient 1.
constexpr double kNormFloor = 1e-8;

[[noreturn]] void not_float(DType dt) {
  throw std::invalid_argument(std::string("op adasum needs floating-point data, not ") + dtype_name(dt));
}

// A vector of the tree: a rank's tensor as it arrived (wire dtype), or a combined one (float64).
struct Operand {
  DType wire = DType::kFloat64;
  const char* data = nullptr;  // `wire` elements
  // elements [i, i + m) as float64: a pointer into `data` (float64) or `buf` (decoded)
  const double* block(size_t i, size_t m, double* buf, float* tmp) const {
    switch (wire) {
      case DType::kFloat64: return reinterpret_cast<const double*>(data) + i;
      case DType::kFloat32: {
        const float* s = reinterpret_cast<const float*>(data) + i;
        for (size_t k = 0; k < m; ++k) buf[k] = s[k];
        return buf;
      }
      case DType::kFloat16:
      case DType::kBFloat16: {
        const CompressKernels& ks = active_kernels();
        (wire == DType::kFloat16 ? ks.fp16 : ks.bf16)
            .decompress(reinterpret_cast<const uint16_t*>(data) + i, tmp, m, 1.0f);
        for (size_t k = 0; k < m; ++k) buf[k] = tmp[k];
        return buf;
      }
      default: not_float(wire);
    }
  }
};

// Where a pair's result goes: a float64 vector (an inner node of the tree), or -- the root -- the
// wire buffer, times the post-scale, rounded once.
struct Sink {
  DType wire = DType::kFloat64;
  char* data = nullptr;
  double scale = 1.0;
  void store(size_t i, size_t m, const double* v, float* tmp) const {
    switch (wire) {
      case DType::kFloat64: {
        double* d = reinterpret_cast<double*>(data) + i;
        for (size_t k = 0; k < m; ++k) d[k] = v[k] * scale;
        return;
      }
      case DType::kFloat32: {
        float* d = reinterpret_cast<float*>(data) + i;
        for (size_t k = 0; k < m; ++k) d[k] = static_cast<float>(v[k] * scale);
        return;
      }
      case DType::kFloat16:
      case DType::kBFloat16: {
        const CompressKernels& ks = active_kernels();
        for (size_t k = 0; k < m; ++k) tmp[k] = static_cast<float>(v[k] * scale);
        (wire == DType::kFloat16 ? ks.fp16 : ks.bf16).compress(tmp, reinterpret_cast<uint16_t*>(data) + i, m, 1.0f);
        return;
      }
      default: not_float(wire);
    }
  }
};

struct Scratch {
  double a[kBlock], b[kBlock], c[kBlock];
  float tmp[kBlock];
};

// out <- adasum(a, b) over `count` elements: one pass for the dot products, one to combine.
void pair(const Operand& a, const Operand& b, const Sink& out, size_t count, int threads) {
  const size_t blocks = (count + kBlock - 1) / kBlock;
  std::vector<double> partial(3 * blocks);
  parallel_for(blocks, threads, 64, 1, [&](size_t lo, size_t hi) {
    auto s = std::make_unique<Scratch>();
    for (size_t k = lo; k < hi; ++k) {
      const size_t i = k * kBlock, m = std::min(kBlock, count - i);
      const double* x = a.block(i, m, s->a, s->tmp);
      const double* y = b.block(i, m, s->b, s->tmp);
      double dot = 0, an = 0, bn = 0;
      for (size_t e = 0; e < m; ++e) {
        dot += x[e] * y[e];
        an += x[e] * x[e];
        bn += y[e] * y[e];
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
  parallel_for(blocks, threads, 64, 1, [&](size_t lo, size_t hi) {
    auto s = std::make_unique<Scratch>();
    for (size_t k = lo; k < hi; ++k) {
      const size_t i = k * kBlock, m = std::min(kBlock, count - i);
      const double* x = a.block(i, m, s->a, s->tmp);
      const double* y = b.block(i, m, s->b, s->tmp);
      for (size_t e = 0; e < m; ++e) s->c[e] = ca * x[e] + cb * y[e];
      out.store(i, m, s->c, s->tmp);
    }
  });
}

// The tree over `leaves` (rank order) into `root`; inner nodes in float64 buffers from `pool`.
void combine(const std::vector<Operand>& leaves, const Sink& root, size_t count, int threads,
             std::vector<std::vector<double>>& pool) {
  const size_t n = leaves.size();
  if (n == 1) {  // nothing to combine: the post-scale and the rounding only
    const Operand& a = leaves[0];
    auto s = std::make_unique<Scratch>();
    for (size_t i = 0; i < count; i += kBlock) {
      const size_t m = std::min(kBlock, count - i);
      root.store(i, m, a.block(i, m, s->a, s->tmp), s->tmp);
    }
    return;
  }
  size_t p = 1;
  while (p * 2 <= n) p *= 2;
  std::vector<Operand> nodes(leaves.begin(), leaves.begin() + p);
  size_t used = 0;
  auto inner = [&]() {
    if (pool.size() <= used) pool.emplace_back();
    std::vector<double>& v = pool[used++];
    if (v.size() < count) v.resize(count);
    return Sink{DType::kFloat64, reinterpret_cast<char*>(v.data()), 1.0};
  };
  auto last = [&](size_t level) { return level * 2 >= p; };  // the tree's top pair
  for (size_t r = p; r < n; ++r) {  // fold the ranks past 2^k into the first ones
    const Sink out = (p == 1) ? root : inner();
    pair(nodes[r - p], leaves[r], out, count, threads);
    nodes[r - p] = Operand{DType::kFloat64, out.data};
  }
  if (p == 1) return;
  for (size_t level = 1; level < p; level *= 2)
    for (size_t r = 0; r + level < p; r += 2 * level) {
      const Sink out = last(level) ? root : inner();
      pair(nodes[r], nodes[r + level], out, count, threads);
      nodes[r] = Operand{DType::kFloat64, out.data};
    }
}

}  // namespace

void adasum_allreduce(Collectives& comm, const AllreduceJob& job, int threads) {
  const Bucket& b = *job.bucket;
  const size_t n = static_cast<size_t>(comm.size());
  const size_t ws = dtype_size(b.wire_dtype), bytes = b.nbytes();
  if (b.wire_dtype != DType::kFloat32 && b.wire_dtype != DType::kFloat64 && b.wire_dtype != DType::kFloat16 &&
      b.wire_dtype != DType::kBFloat16)
    not_float(b.dtype);
  // Buffers kept between calls (one engine thread per engine): a step's buckets reuse the pages
  // of the last step's instead of faulting fresh ones in.
  thread_local std::vector<char> mine, all, result;
  thread_local std::vector<std::vector<double>> pool;
  if (mine.size() < bytes) mine.resize(bytes);
  if (all.size() < n * bytes) all.resize(n * bytes);
  if (result.size() < bytes) result.resize(bytes);
  pack(b, job.srcs, mine.data(), job.prescale, threads);
  comm.allgather(mine.data(), all.data(), std::vector<size_t>(n, bytes));
  ScopedIeeeFpEnv env;
  std::vector<Operand> leaves(n);
  for (size_t t = 0; t < b.tensors.size(); ++t) {
    const size_t off = b.offsets[t], count = b.numels[t];
    if (count == 0) continue;
    for (size_t j = 0; j < n; ++j) leaves[j] = Operand{b.wire_dtype, all.data() + j * bytes + off * ws};
    combine(leaves, Sink{b.wire_dtype, result.data() + off * ws, job.postscale}, count, threads, pool);
  }
  unpack(b, result.data(), job.outs, 1.0, threads);
}

}  // namespace fastxfer
