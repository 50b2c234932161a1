// C++ tests of the core, independent of Python: every SIMD table against the scalar reference on
// random bit patterns, pack_range/unpack_range on arbitrary ranges, the bucket planner's
// invariants, reduce_block against a plain loop, CPU-list parsing. Built with
// -DFASTXFER_BUILD_CPP_TESTS=ON and run by ctest (tests/test_cpp.py does both).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/compress.h"
#include "kernels/reference.h"
#include "kernels/reduce.h"
#include "fusion/bucket_planner.h"
#include "fusion/pack.h"
#include "topology/topology.h"

using namespace fastxfer;

static int failures = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      ++failures;                                               \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                 \
      std::printf("\n");                                        \
    }                                                           \
  } while (0)

static std::vector<float> random_floats(std::mt19937& rng, size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) {
    uint32_t u = rng();
    std::memcpy(&x, &u, 4);
  }
  return v;
}

static void test_kernels_match_reference() {
  std::mt19937 rng(1);
  for (SimdLevel level : supported_simd_levels()) {
    set_simd_level(level);
    const CompressKernels& k = active_kernels();
    for (size_t n : {0, 1, 7, 15, 16, 17, 33, 1000, 65537}) {
      auto x = random_floats(rng, n);
      std::vector<uint16_t> b(n), h(n);
      k.bf16.compress(x.data(), b.data(), n, 1.0f);
      k.fp16.compress(x.data(), h.data(), n, 1.0f);
      for (size_t i = 0; i < n; ++i) {
        CHECK(b[i] == ref::f32_to_bf16(x[i]), "%s bf16 n=%zu i=%zu", simd_level_name(level), n, i);
        CHECK(h[i] == ref::f32_to_f16(x[i]), "%s fp16 n=%zu i=%zu", simd_level_name(level), n, i);
      }
      std::vector<float> back(n);
      k.fp16.decompress(h.data(), back.data(), n, 1.0f);
      for (size_t i = 0; i < n; ++i) {
        float r = ref::f16_to_f32(h[i]);
        CHECK(std::memcmp(&back[i], &r, 4) == 0, "%s fp16 back i=%zu", simd_level_name(level), i);
      }
    }
  }
  set_simd_level(best_simd_level());
}

static void test_pack_ranges_roundtrip() {
  std::mt19937 rng(2);
  std::vector<TensorSpec> specs;
  std::vector<std::vector<float>> ts;
  for (int i = 0; i < 40; ++i) {
    size_t n = rng() % 3000;
    specs.push_back({n, DType::kFloat32});
    std::vector<float> t(n);
    for (auto& x : t) x = static_cast<float>(static_cast<int>(rng() % 200) - 100);
    ts.push_back(t);
  }
  for (Compression c : {Compression::kNone, Compression::kBF16}) {
    auto buckets = BucketPlanner(1 << 30, 1 << 30, c).plan(specs);
    CHECK(buckets.size() == 1, "one bucket");
    const Bucket& b = buckets[0];
    std::vector<const void*> srcs;
    for (int t : b.tensors) srcs.push_back(ts[t].data());
    const size_t es = dtype_size(b.wire_dtype);
    std::vector<char> whole(b.nbytes()), pieces(b.nbytes(), 0x55);
    pack(b, srcs, whole.data(), 1.0, 1);
    // pack in random ranges: must give the same bytes
    for (size_t lo = 0; lo < b.numel;) {
      size_t hi = std::min(b.numel, lo + 1 + rng() % 5000);
      pack_range(b, srcs, pieces.data() + lo * es, lo, hi, 1.0, 1);
      lo = hi;
    }
    CHECK(whole == pieces, "pack_range pieces == pack (compression %d)", static_cast<int>(c));
    std::vector<std::vector<float>> outs(ts.size());
    std::vector<void*> dsts;
    for (int t : b.tensors) {
      outs[t].assign(ts[t].size(), -7.0f);
      dsts.push_back(outs[t].data());
    }
    for (size_t lo = 0; lo < b.numel;) {
      size_t hi = std::min(b.numel, lo + 1 + rng() % 5000);
      unpack_range(b, whole.data() + lo * es, dsts, lo, hi, 1.0, 1);
      lo = hi;
    }
    for (size_t t = 0; t < ts.size(); ++t) CHECK(outs[t] == ts[t], "unpack_range tensor %zu", t);
    // segments cover exactly the tensor elements of a range
    size_t covered = 0;
    for (const Segment& s : segments(b, 0, b.numel)) covered += s.count;
    size_t total = 0;
    for (auto& t : ts) total += t.size();
    CHECK(covered == total, "segments cover %zu of %zu", covered, total);
  }
}

static void test_planner_invariants() {
  std::mt19937 rng(3);
  std::vector<TensorSpec> specs;
  const DType dts[] = {DType::kFloat32, DType::kFloat64, DType::kInt32};
  for (int i = 0; i < 500; ++i) specs.push_back({rng() % 100000, dts[rng() % 3]});
  auto buckets = BucketPlanner(300000, 50000, Compression::kFP16).plan(specs);
  std::vector<int> seen(specs.size(), 0);
  int last = -1;
  for (const Bucket& b : buckets) {
    CHECK(b.tensors.back() > last, "completion order");
    last = b.tensors.back();
    for (size_t j = 0; j < b.tensors.size(); ++j) {
      ++seen[b.tensors[j]];
      CHECK(specs[b.tensors[j]].dtype == b.dtype, "one dtype per bucket");
      CHECK(b.offsets[j] * dtype_size(b.wire_dtype) % 64 == 0, "64-byte aligned");
    }
    CHECK(b.tensors.size() == 1 || b.nbytes() <= 300000, "cap respected unless a lone oversized tensor");
  }
  for (int s : seen) CHECK(s == 1, "every tensor in exactly one bucket");
}

static void test_reduce_block() {
  std::vector<float> a = {1, 2, NAN, 4}, b = {4, 1, 1, -INFINITY};
  const void* srcs[] = {a.data(), b.data()};
  std::vector<float> out(4);
  reduce_block(ReduceOp::kMax, DType::kFloat32, srcs, 2, out.data(), 4, 1.0);
  CHECK(out[0] == 4 && out[1] == 2 && std::isnan(out[2]) && out[3] == 4, "max with NaN");
  reduce_block(ReduceOp::kAverage, DType::kFloat32, srcs, 2, out.data(), 4, 0.5);
  CHECK(out[0] == 2.5f && out[1] == 1.5f && out[3] == -INFINITY, "average");
  std::vector<int32_t> i1 = {2147483647, -5}, i2 = {1, 5};
  const void* isrcs[] = {i1.data(), i2.data()};
  std::vector<int32_t> iout(2);
  reduce_block(ReduceOp::kSum, DType::kInt32, isrcs, 2, iout.data(), 2, 1.0);
  CHECK(iout[0] == -2147483647 - 1 && iout[1] == 0, "int32 sum wraps like numpy");
}

static void test_cpu_lists() {
  CHECK(format_cpu_list({5, 0, 1, 2, 7, 8, 3}) == "0-3,5,7-8", "format");
  CHECK(parse_cpu_list("0-3,5,7-8\n", "x") == std::vector<int>({0, 1, 2, 3, 5, 7, 8}), "parse");
  bool threw = false;
  try {
    parse_cpu_list("3-1", "x");
  } catch (const TopologyError&) {
    threw = true;
  }
  CHECK(threw, "reversed range rejected");
}

int main() {
  test_kernels_match_reference();
  test_pack_ranges_roundtrip();
  test_planner_invariants();
  test_reduce_block();
  test_cpu_lists();
  if (failures) {
    std::printf("%d failed\n", failures);
    return 1;
  }
  std::printf("all C++ core tests passed\n");
  return 0;
}
