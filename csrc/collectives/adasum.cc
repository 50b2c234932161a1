// Adasum (collectives/adasum.h): the pairwise rule, the tree over the ranks, and the fused
// allreduce that gathers every rank's bucket and combines it locally.
#include "collectives/adasum.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <memory>
#include <string>

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

// Dot product and squared norms of a and b over elements [lo, hi), in blocks of kBlock summed in
// order (kLanes independent sums each, which the compiler vectorizes): the same bits whatever
// the number of threads.
void dots(const Operand& a, const Operand& b, size_t lo, size_t hi, Scratch& s, double out[3]) {
  double sd = 0, sa = 0, sb = 0;
  for (size_t i = lo; i < hi; i += kBlock) {
    const size_t m = std::min(kBlock, hi - i);
    const double* x = a.block(i, m, s.a, s.tmp);
    const double* y = b.block(i, m, s.b, s.tmp);
    constexpr size_t kLanes = 8;
    double dot[kLanes] = {}, an[kLanes] = {}, bn[kLanes] = {};
    size_t e = 0;
    for (; e + kLanes <= m; e += kLanes)
      for (size_t l = 0; l < kLanes; ++l) {
        dot[l] += x[e + l] * y[e + l];
        an[l] += x[e + l] * x[e + l];
        bn[l] += y[e + l] * y[e + l];
      }
    for (size_t l = 0; e < m; ++e, ++l) {
      dot[l] += x[e] * y[e];
      an[l] += x[e] * x[e];
      bn[l] += y[e] * y[e];
    }
    for (size_t l = 0; l < kLanes; ++l) {
      sd += dot[l];
      sa += an[l];
      sb += bn[l];
    }
  }
  out[0] = sd;
  out[1] = sa;
  out[2] = sb;
}

// out[lo, hi) <- ca * a + cb * b
void scaled_add(const Operand& a, const Operand& b, double ca, double cb, const Sink& out, size_t lo, size_t hi,
                Scratch& s) {
  for (size_t i = lo; i < hi; i += kBlock) {
    const size_t m = std::min(kBlock, hi - i);
    const double* x = a.block(i, m, s.a, s.tmp);
    const double* y = b.block(i, m, s.b, s.tmp);
    for (size_t e = 0; e < m; ++e) s.c[e] = ca * x[e] + cb * y[e];
    out.store(i, m, s.c, s.tmp);
  }
}

// Horovod's coefficients from the pair's dot product and squared norms.
void coefficients(const double d[3], double& ca, double& cb) {
  ca = d[1] >= kNormFloor ? 1.0 - d[0] / d[1] * 0.5 : 1.0;
  cb = d[2] >= kNormFloor ? 1.0 - d[0] / d[2] * 0.5 : 1.0;
}

// The pairs of the tree, level by level: (a, b) combines node b into node a. First the fold of
// the ranks past the largest power of two p, then the binary tree over 0..p-1.
std::vector<std::vector<std::pair<size_t, size_t>>> tree(size_t n) {
  std::vector<std::vector<std::pair<size_t, size_t>>> levels;
  size_t p = 1;
  while (p * 2 <= n) p *= 2;
  if (n > p) {
    levels.emplace_back();
    for (size_t r = p; r < n; ++r) levels.back().push_back({r - p, r});
  }
  for (size_t level = 1; level < p; level *= 2) {
    levels.emplace_back();
    for (size_t r = 0; r + level < p; r += 2 * level) levels.back().push_back({r, r + level});
  }
  return levels;
}

}  // namespace

void adasum_allreduce(Collectives& comm, const AllreduceJob& job, int threads) {
  const Bucket& b = *job.bucket;
  const size_t n = static_cast<size_t>(comm.size()), me = static_cast<size_t>(comm.rank());
  const size_t ws = dtype_size(b.wire_dtype), bytes = b.nbytes();
  if (b.wire_dtype != DType::kFloat32 && b.wire_dtype != DType::kFloat64 && b.wire_dtype != DType::kFloat16 &&
      b.wire_dtype != DType::kBFloat16)
    not_float(b.dtype);
  // Rank j owns packed elements [lo(j), lo(j + 1)) of the bucket (64-byte multiples).
  const size_t align = 64 / ws;
  const size_t per = (b.numel + n * align - 1) / (n * align) * align;
  auto lo = [&](size_t j) { return std::min(b.numel, per * j); };
  const size_t mine_lo = lo(me), mine_n = lo(me + 1) - mine_lo;
  // Buffers kept between calls (one engine thread per engine): a step's buckets reuse the pages
  // of the last step's instead of faulting fresh ones in.
  thread_local std::vector<char> packed, shards, result;
  thread_local std::vector<std::vector<double>> pool;
  if (packed.size() < bytes) packed.resize(bytes);
  if (shards.size() < n * per * ws) shards.resize(n * per * ws);
  if (result.size() < bytes) result.resize(bytes);
  pack(b, job.srcs, packed.data(), job.prescale, threads);
  // 1. Every rank's piece of my shard (an alltoall: rank j's packed buffer is its shards in order).
  std::vector<size_t> matrix(n * n);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j) matrix[i * n + j] = (lo(j + 1) - lo(j)) * ws;
  comm.alltoall(packed.data(), shards.data(), matrix);

  // The tensors' parts inside my shard, in shard coordinates.
  struct Part {
    size_t begin, end;
  };
  std::vector<Part> parts;
  for (size_t t = 0; t < b.tensors.size(); ++t) {
    const size_t s = std::max(b.offsets[t], mine_lo), e = std::min(b.offsets[t] + b.numels[t], mine_lo + mine_n);
    parts.push_back(s < e ? Part{s - mine_lo, e - mine_lo} : Part{0, 0});
  }
  const size_t nt = parts.size();
  ScopedIeeeFpEnv env;
  auto scratch = std::make_unique<Scratch>();
  std::vector<Operand> nodes(n);
  for (size_t j = 0; j < n; ++j) nodes[j] = Operand{b.wire_dtype, shards.data() + j * mine_n * ws};
  const Sink root{b.wire_dtype, result.data() + mine_lo * ws, job.postscale};
  const auto levels = tree(n);
  size_t used = 0;
  for (size_t lv = 0; lv < levels.size(); ++lv) {
    const auto& pairs = levels[lv];
    // 2. This level's dot products over my shard, summed over every rank in rank order.
    std::vector<double> mine(pairs.size() * nt * 3, 0.0), every(n * mine.size());
    for (size_t q = 0; q < pairs.size(); ++q)
      for (size_t t = 0; t < nt; ++t)
        if (parts[t].begin < parts[t].end)
          dots(nodes[pairs[q].first], nodes[pairs[q].second], parts[t].begin, parts[t].end, *scratch,
               &mine[(q * nt + t) * 3]);
    comm.allgather(mine.data(), every.data(), std::vector<size_t>(n, mine.size() * sizeof(double)));
    for (size_t k = 0; k < mine.size(); ++k) {
      double sum = 0;
      for (size_t j = 0; j < n; ++j) sum += every[j * mine.size() + k];
      mine[k] = sum;
    }
    // 3. Combine: into a float64 node, or -- the top of the tree -- into the result.
    const bool top = lv + 1 == levels.size();
    for (size_t q = 0; q < pairs.size(); ++q) {
      Sink out = root;
      if (!top) {
        if (pool.size() <= used) pool.emplace_back();
        std::vector<double>& v = pool[used++];
        if (v.size() < mine_n) v.resize(mine_n);
        out = Sink{DType::kFloat64, reinterpret_cast<char*>(v.data()), 1.0};
      }
      for (size_t t = 0; t < nt; ++t) {
        if (parts[t].begin >= parts[t].end) continue;
        double ca, cb;
        coefficients(&mine[(q * nt + t) * 3], ca, cb);
        scaled_add(nodes[pairs[q].first], nodes[pairs[q].second], ca, cb, out, parts[t].begin, parts[t].end,
                   *scratch);
      }
      nodes[pairs[q].first] = Operand{DType::kFloat64, out.data};
    }
  }
  if (levels.empty())  // one rank: the post-scale and the rounding only
    for (size_t t = 0; t < nt; ++t)
      for (size_t i = parts[t].begin; i < parts[t].end; i += kBlock) {
        const size_t m = std::min(kBlock, parts[t].end - i);
        root.store(i, m, nodes[0].block(i, m, scratch->a, scratch->tmp), scratch->tmp);
      }
  // 4. Every rank's reduced shard, in place in the result buffer (the shards are its pieces in order).
  std::vector<size_t> sizes(n);
  for (size_t j = 0; j < n; ++j) sizes[j] = (lo(j + 1) - lo(j)) * ws;
  std::vector<char>& gathered = packed;  // free again: reuse its pages
  comm.allgather(result.data() + mine_lo * ws, gathered.data(), sizes);
  unpack(b, gathered.data(), job.outs, 1.0, threads);
}

}  // namespace fastxfer
