// C++ tests of the core, independent of Python: every SIMD table against the scalar reference on
// random bit patterns, pack_range/unpack_range on arbitrary ranges, the bucket planner's
// invariants, reduce_block against a plain loop, CPU-list parsing, the process-wide settings (set
// through the same calls _core.configure makes: the core reads no environment). Built with
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
#include "collectives/hierarchical.h"
#include "common/errors.h"
#include "common/output_pool.h"
#include "common/parallel.h"
#include "common/waiting.h"
#include "engine/engine.h"
#include "engine/request_builder.h"
#include "transport/heartbeat.h"
#include "transport/shm/segment.h"
#include "transport/shm/sync.h"

#include <arpa/inet.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

using namespace fastxfer;

// Every operator new of this process, counted (test_small_allreduce_allocates_nothing).
static std::atomic<long> g_news{0};
void* operator new(size_t n) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

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
    if (c == Compression::kNone) {
      // the non-temporal pack: the same bytes, padding zeros included, into a misaligned buffer too
      for (size_t shift : {size_t(0), size_t(4), size_t(12)}) {
        std::vector<char> raw(b.nbytes() + 128, 0x55);
        char* dst = raw.data() + (64 - reinterpret_cast<uintptr_t>(raw.data()) % 64) % 64;
        pack_for_peers(b, srcs, dst + shift);
        CHECK(std::memcmp(dst + shift, whole.data(), b.nbytes()) == 0, "pack_for_peers == pack (shift %zu)", shift);
      }
    }
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

  // plan_into gives plan()'s buckets, one dtype or several, into a vector that held another plan
  // (more buckets, fewer, or none): what the engine's fused runs reuse between rounds.
  auto same = [](const std::vector<Bucket>& x, const std::vector<Bucket>& y) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (x[i].dtype != y[i].dtype || x[i].compression != y[i].compression || x[i].wire_dtype != y[i].wire_dtype ||
          x[i].tensors != y[i].tensors || x[i].offsets != y[i].offsets || x[i].numels != y[i].numels ||
          x[i].numel != y[i].numel)
        return false;
    return true;
  };
  std::vector<Bucket> into;
  for (int trial = 0; trial < 60; ++trial) {
    const bool mixed = trial % 4 == 3;
    std::vector<TensorSpec> run;
    const size_t count = rng() % 40;
    for (size_t i = 0; i < count; ++i)
      run.push_back({rng() % 3 == 0 ? rng() % 200000 : rng() % 300, mixed ? dts[rng() % 3] : dts[trial % 3]});
    const size_t cap = 1000 + rng() % 400000, first = 1 + rng() % cap;
    for (Compression c : {Compression::kNone, Compression::kBF16}) {
      const BucketPlanner p(cap, first, c);
      p.plan_into(run, into);
      CHECK(same(into, p.plan(run)), "plan_into == plan (trial %d, %zu tensors, cap %zu, first %zu, mixed %d)", trial,
            count, cap, first, mixed);
    }
  }
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
  // issue 15: 8/16-bit integers wrap (sum and product), averages truncate toward zero, bool or/and
  std::vector<uint8_t> u1 = {200, 16, 3}, u2 = {100, 16, 4}, uout(3);
  const void* usrcs[] = {u1.data(), u2.data()};
  reduce_block(ReduceOp::kSum, DType::kUInt8, usrcs, 2, uout.data(), 3, 1.0);
  CHECK(uout[0] == 44 && uout[1] == 32 && uout[2] == 7, "uint8 sum wraps");
  reduce_block(ReduceOp::kProduct, DType::kUInt8, usrcs, 2, uout.data(), 3, 1.0);
  CHECK(uout[0] == 32 && uout[1] == 0 && uout[2] == 12, "uint8 product wraps");
  std::vector<uint16_t> w1 = {65535}, w2 = {65535}, wout(1);
  const void* wsrcs[] = {w1.data(), w2.data()};
  reduce_block(ReduceOp::kProduct, DType::kUInt16, wsrcs, 2, wout.data(), 1, 1.0);
  CHECK(wout[0] == 1, "uint16 product wraps without int promotion overflow");
  std::vector<int16_t> s1 = {-3, 7}, s2 = {0, 14}, sout(2);
  const void* ssrcs[] = {s1.data(), s2.data()};
  reduce_block(ReduceOp::kAverage, DType::kInt16, ssrcs, 2, sout.data(), 2, 0.5);
  CHECK(sout[0] == -1 && sout[1] == 10, "int16 average truncates toward zero");
  std::vector<uint8_t> b1 = {0, 0, 1, 1}, b2 = {0, 7, 0, 1}, bout(4);
  const void* bsrcs[] = {b1.data(), b2.data()};
  reduce_block(ReduceOp::kSum, DType::kBool, bsrcs, 2, bout.data(), 4, 1.0);
  CHECK(bout[0] == 0 && bout[1] == 1 && bout[2] == 1 && bout[3] == 1, "bool sum is or");
  reduce_block(ReduceOp::kMin, DType::kBool, bsrcs, 2, bout.data(), 4, 1.0);
  CHECK(bout[0] == 0 && bout[1] == 0 && bout[2] == 0 && bout[3] == 1, "bool min is and");
}

// The 16-bit reduce kernels (sum2_wire, min/max_accumulate) and reduce_block(_direct) on bf16/fp16
// tensors, on every SIMD table, against a plain loop over the reference conversions: random bit
// patterns (NaN payloads, infinities, subnormals), unaligned pointers, every tail length, with
// and without streaming stores.
struct Ref16 {
  uint16_t (*enc)(float);
  float (*dec)(uint16_t);
};
static float ref_combine(ReduceOp op, float a, float x) {
  if (op == ReduceOp::kMin) return (a < x || std::isnan(a)) ? a : x;
  if (op == ReduceOp::kMax) return (a > x || std::isnan(a)) ? a : x;
  // sum: NaN + anything is the earlier rank's NaN, quieted (the kernels' documented rule)
  if (std::isnan(a)) return ref::bits_f32(ref::f32_bits(a) | 0x00400000u);
  return a + x;
}
static uint16_t ref_reduce16(const Ref16& r, ReduceOp op, const std::vector<const uint16_t*>& srcs, size_t i,
                             float scale) {
  float acc = r.dec(srcs[0][i]);
  for (size_t j = 1; j < srcs.size(); ++j) acc = ref_combine(op, acc, r.dec(srcs[j][i]));
  return r.enc(scale == 1.0f ? acc : acc * scale);
}

static void test_16bit_reduce_matches_reference() {
  std::mt19937 rng(4);
  const Ref16 refs[] = {{ref::f32_to_bf16, ref::bf16_to_f32}, {ref::f32_to_f16, ref::f16_to_f32}};
  const DType dts[] = {DType::kBFloat16, DType::kFloat16};
  const size_t kMax = 70000 + 64;
  std::vector<uint16_t> bufs[3];
  for (auto& b : bufs) {
    b.resize(kMax);
    for (auto& x : b) x = static_cast<uint16_t>(rng());
  }
  for (SimdLevel level : supported_simd_levels()) {
    set_simd_level(level);
    const CompressKernels& k = active_kernels();
    const char* L = simd_level_name(level);
    for (int t = 0; t < 2; ++t) {
      const WireKernels& w = t == 0 ? k.bf16 : k.fp16;
      const Ref16& r = refs[t];
      for (size_t n : {0, 1, 15, 16, 17, 31, 32, 33, 63, 1000, 2049, 4097, 70000}) {
        for (size_t off : {0, 1, 3}) {
          const uint16_t* a = bufs[0].data() + off;
          const uint16_t* b = bufs[1].data() + 2 * off;
          const uint16_t* c = bufs[2].data();
          for (float scale : {1.0f, 0.5f, 1.0f / 3.0f}) {
            for (bool stream : {false, true}) {
              ScopedStreamStores ss(stream);
              std::vector<uint16_t> dst(n + 8), out(n + 8, 0xabcd);
              w.sum2_wire(a, b, dst.data() + off, out.data() + off, n, scale);
              for (size_t i = 0; i < n; ++i) {
                uint16_t want = ref_reduce16(r, ReduceOp::kSum, {a, b}, i, scale);
                CHECK(dst[off + i] == want && out[off + i] == want, "%s sum2_wire t=%d n=%zu i=%zu", L, t, n, i);
                if (dst[off + i] != want) break;
              }
              CHECK(out[off + n] == 0xabcd, "%s sum2_wire wrote past the end", L);
            }
            // no `out`, and dst aliasing the first source
            std::vector<uint16_t> inplace(a, a + n);
            w.sum2_wire(inplace.data(), b, inplace.data(), nullptr, n, scale);
            for (size_t i = 0; i < n; ++i)
              CHECK(inplace[i] == ref_reduce16(r, ReduceOp::kSum, {a, b}, i, scale), "%s in place i=%zu", L, i);
          }
          for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
            std::vector<float> acc(n);
            for (size_t i = 0; i < n; ++i) acc[i] = r.dec(a[i]);
            (op == ReduceOp::kMin ? w.min_accumulate : w.max_accumulate)(acc.data(), b, n);
            for (size_t i = 0; i < n; ++i) {
              float want = ref_combine(op, r.dec(a[i]), r.dec(b[i]));
              CHECK(std::memcmp(&acc[i], &want, 4) == 0, "%s minmax t=%d n=%zu i=%zu", L, t, n, i);
            }
          }
          // the engine's entry points, 2 and 3 ranks, every op, own tensor read directly
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMin, ReduceOp::kMax}) {
            for (int nsrc : {2, 3}) {
              const double scale = op == ReduceOp::kAverage ? 1.0 / nsrc : 1.0;
              std::vector<const uint16_t*> v = {a, b, c};
              v.resize(nsrc);
              const void* srcs[3] = {a, b, c};
              std::vector<uint16_t> dst(n), out(n);
              for (int self = 0; self < nsrc; ++self) {
                reduce_block_direct(op, dts[t], dts[t], srcs, nsrc, self, dst.data(), out.data(), n, scale);
                for (size_t i = 0; i < n; ++i) {
                  uint16_t want = ref_reduce16(r, op, v, i, static_cast<float>(scale));
                  CHECK(dst[i] == want && out[i] == want, "%s direct op=%d nsrc=%d i=%zu", L, int(op), nsrc, i);
                  if (dst[i] != want) break;
                }
              }
              reduce_block(op, dts[t], srcs, nsrc, dst.data(), n, scale);
              for (size_t i = 0; i < n; ++i) {
                CHECK(dst[i] == ref_reduce16(r, op, v, i, static_cast<float>(scale)), "%s block op=%d i=%zu", L,
                      int(op), i);
                if (dst[i] != ref_reduce16(r, op, v, i, static_cast<float>(scale))) break;
              }
            }
          }
        }
      }
    }
  }
  set_simd_level(best_simd_level());
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

// A lane whose job is stuck (on a lost host) can be interrupted: wait() throws PeerFailure with
// the reason at once, the job goes on alone, and later waits fail the same way.
static void test_net_lane_interrupt() {
  std::atomic<bool> release{false};
  {
    NetLane lane;
    lane.post([&] {
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    std::thread t([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      lane.interrupt("lost host hX");
    });
    std::string got;
    try {
      lane.wait();
    } catch (const PeerFailure& e) {
      got = e.what();
    }
    t.join();
    CHECK(got == "lost host hX", "interrupted wait threw '%s'", got.c_str());
    CHECK(lane.busy(), "the stuck job still runs");
    release.store(true);
    for (int i = 0; i < 2000 && lane.busy(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(!lane.busy(), "the job ended once released");
    CHECK(!lane.wait_for(0.01), "an interrupted lane's wait_for fails");
  }
}

// Heartbeats: a peer sending beats with the wrong token never arms the deadline; one that sends
// valid beats and goes silent is reported lost once, named, after the timeout; two real
// heartbeats never report each other, and one that stops says goodbye first.
static void test_heartbeat() {
  using clock = std::chrono::steady_clock;
  const double timeout = 0.5;
  std::mutex mu;
  std::vector<std::pair<double, std::string>> fired;
  const auto t0 = clock::now();
  auto since = [&] { return std::chrono::duration<double>(clock::now() - t0).count(); };
  auto on_lost = [&](const std::string& why) {
    std::lock_guard<std::mutex> lk(mu);
    fired.emplace_back(since(), why);
  };
  // A fake peer: a plain UDP socket speaking the 32-byte wire format.
  int fake = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in fa{};
  fa.sin_family = AF_INET;
  fa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fake, reinterpret_cast<sockaddr*>(&fa), sizeof fa);
  socklen_t fl = sizeof fa;
  getsockname(fake, reinterpret_cast<sockaddr*>(&fa), &fl);
  const std::string fake_ep = std::to_string(ntohs(fa.sin_port)) + " 127.0.0.1";
  CHECK(HostHeartbeat::parse_endpoint(fake_ep, false).empty(), "loopback dropped for another machine");
  CHECK(HostHeartbeat::parse_endpoint(fake_ep, true).size() == 1, "loopback kept on the same machine");
  {
    HostHeartbeat d;
    d.start(0, 42, {{7, "hz", HostHeartbeat::parse_endpoint(fake_ep, true)}}, 0.05, timeout, on_lost);
    std::vector<sockaddr_in> to = HostHeartbeat::parse_endpoint(d.endpoint(), true);
    CHECK(!to.empty(), "an endpoint with addresses: %s", d.endpoint().c_str());
    auto beat = [&](uint64_t token) {
      struct { uint32_t magic, type; uint64_t token; int32_t from, to; uint64_t seq; } pk{0x42485846, 1, token, 7, 0, 1};
      for (const auto& a : to) sendto(fake, &pk, sizeof pk, 0, reinterpret_cast<const sockaddr*>(&a), sizeof a);
    };
    for (int i = 0; i < 20; ++i) {  // 1 s of another job's beats
      beat(41);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      CHECK(fired.empty(), "armed by a datagram with the wrong token");
    }
    for (int i = 0; i < 6; ++i) {
      beat(42);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const double silent = since();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    std::lock_guard<std::mutex> lk(mu);
    CHECK(fired.size() == 1, "lost once, got %zu reports", fired.size());
    if (fired.size() == 1) {
      const double after = fired[0].first - silent;
      CHECK(after >= timeout - 0.05 && after < timeout + 0.6, "reported %.2f s after the last beat", after);
      CHECK(fired[0].second.find("lost host hz (rank 7)") == 0, "message: %s", fired[0].second.c_str());
    }
    fired.clear();
  }
  close(fake);
  {
    auto a = std::make_unique<HostHeartbeat>();
    auto b = std::make_unique<HostHeartbeat>();
    a->start(0, 9, {{1, "hb", HostHeartbeat::parse_endpoint(b->endpoint(), true)}}, 0.05, timeout, on_lost);
    b->start(1, 9, {{0, "ha", HostHeartbeat::parse_endpoint(a->endpoint(), true)}}, 0.05, timeout, on_lost);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    b.reset();  // says goodbye
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    std::lock_guard<std::mutex> lk(mu);
    CHECK(fired.empty(), "a live peer or one that said goodbye reported lost: %s",
          fired.empty() ? "" : fired[0].second.c_str());
  }
}

// The spin of a wait grows after waits that slept and ended soon after, only on a thread waiting
// for its own result (common/waiting.h), and is back at FASTXFER_SPIN_US after a long wait: two
// ranks of one segment on two threads, rank 1 waiting for rank 0's counter, published after a
// pause each time.
static void test_wait_spin_adapts_on_own_result_waits() {
  ShmConfig cfg;
  cfg.name = "/dev/shm/fastxfer-test-core-spin-" + std::to_string(getpid());
  cfg.size = 2;
  cfg.window_bytes = 64u << 10;
  cfg.oob_bytes = 4096;
  cfg.max_records = 16;
  cfg.attach_timeout_s = 30;
  cfg.spin_us = 50;
  cfg.spin_max_us = 5000;
  std::unique_ptr<ShmSegment> s0, s1;
  std::string err0, err1;  // one each: the two attach at once
  auto attach = [&cfg](int rank, std::unique_ptr<ShmSegment>& seg, std::string& err) {
    ShmConfig c = cfg;
    c.rank = rank;
    try {
      seg = std::make_unique<ShmSegment>(c);
    } catch (const std::exception& e) {
      err = e.what();
    }
  };
  std::thread t0([&] { attach(0, s0, err0); });
  attach(1, s1, err1);
  t0.join();
  CHECK(s0 && s1, "two ranks on two threads: %s%s", err0.c_str(), err1.c_str());
  if (!s0 || !s1) return;
  uint32_t value = 0;
  // rank 1 waits (on this thread) for rank 0's next value, published `pause_ms` later
  auto wait_for_publish = [&](int pause_ms, bool own) {
    ++value;
    std::thread pub([&, v = value] {
      std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
      s0->publish(Phase::kReady, v);
    });
    std::optional<OwnResultWait> scope;
    if (own) scope.emplace();
    s1->wait_one(0, Phase::kReady, value, "test");
    pub.join();
  };
  const double base = cfg.spin_us * 1e-6, most = cfg.spin_max_us * 1e-6;  // as the segment forms them
  CHECK(s1->spin_s() == base, "starts at spin_us: %g", s1->spin_s());
  wait_for_publish(1, false);
  CHECK(s1->spin_s() == base, "the engine thread's kind of wait changed the spin: %g", s1->spin_s());
  wait_for_publish(1, true);  // slept, over within 2 x spin_max: longer
  const double grown = s1->spin_s();
  CHECK(grown > base && grown <= most, "a short wait that slept gave a spin of %g s", grown);
  wait_for_publish(1, true);
  CHECK(s1->spin_s() >= grown && s1->spin_s() <= most, "a second one gave %g s after %g", s1->spin_s(), grown);
  wait_for_publish(40, true);  // a peer computing: back to the short spin
  CHECK(s1->spin_s() == base, "a 40 ms wait left the spin at %g s", s1->spin_s());
  s1.reset();
  s0.reset();
  unlink(cfg.name.c_str());
}

// A counter that several processes add to loses no count: threads hammer one with increment()
// (the start-up count of attached ranks was once a fetch_add followed by a store of the result,
// which put an older count back when two ranks attached at the same moment: a 3-rank job then
// failed with "only 2 of 3 ranks attached" on every rank).
static void test_counter_increment_loses_nothing() {
  shm::Counter c{};
  const int threads = 4, each = 1000000;
  std::atomic<int> ready{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&] {
      ready.fetch_add(1);
      while (ready.load() < threads) {  // all start at once, so the additions interleave
      }
      for (int i = 0; i < each; ++i) shm::increment(c);
    });
  for (auto& t : ts) t.join();
  CHECK(c.value.load() == static_cast<uint32_t>(threads * each), "counted %u of %d", c.value.load(), threads * each);
}

// Ranks that attach to a segment at the same moment all count: 8 forked ranks start together
// (a shared go flag) on a fresh segment, 20 times; every one must get through start-up within
// its 20 s, and rank 0 must have unlinked the name afterwards.
static void test_segment_ranks_attaching_together() {
  const int ranks = 8, rounds = 20;
  auto* go = static_cast<std::atomic<int>*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  CHECK(go != MAP_FAILED, "mmap of the start flag");
  if (go == MAP_FAILED) return;
  for (int round = 0; round < rounds; ++round) {
    ShmConfig cfg;
    cfg.name = "/dev/shm/fastxfer-test-core-" + std::to_string(getpid()) + "-" + std::to_string(round);
    cfg.size = ranks;
    cfg.window_bytes = 64u << 10;
    cfg.oob_bytes = 4096;
    cfg.max_records = 16;
    cfg.attach_timeout_s = 20;
    go[0].store(0);
    go[1].store(0);
    std::fflush(stdout);  // the children would print what is still buffered again
    std::vector<pid_t> kids;
    for (int r = 0; r < ranks; ++r) {
      pid_t pid = fork();
      if (pid == 0) {
        cfg.rank = r;
        if (r != 0)  // the others may come first: they wait for rank 0's file
          while (go[0].load() == 0) {
          }
        int rc = 0;
        try {
          ShmSegment seg(cfg);
          // stay mapped until every rank is through: one that left at once would look dead to a
          // rank still in start-up
          go[1].fetch_add(1);
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (go[1].load() < ranks && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        } catch (const std::exception& e) {
          go[1].fetch_add(1);
          std::printf("rank %d of round %d: %s\n", r, round, e.what());
          rc = 1;
        }
        std::fflush(stdout);
        _exit(rc);
      }
      kids.push_back(pid);
    }
    go[0].store(1);
    int failed = 0;
    for (pid_t k : kids) {
      int st = 0;
      waitpid(k, &st, 0);
      failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    CHECK(failed == 0, "round %d: %d of %d ranks failed to start together", round, failed, ranks);
    CHECK(access(cfg.name.c_str(), F_OK) != 0, "round %d left %s behind", round, cfg.name.c_str());
    if (failed) {
      unlink(cfg.name.c_str());
      break;
    }
  }
  munmap(go, 4096);
}

// A small synchronous allreduce allocates nothing once the engine is warm (docs/architecture.md,
// "Small allreduces"): two forked ranks on one segment each run 300 average allreduces of 1024
// float32, the last 200 counted, and check every result exactly, on each path: with the records
// (the one-exchange path, tuner off), through the chunks (eager_bytes 0), and as the tuner picks
// (its default, both paths in its trial rounds). The one
// allowance is the request queue's: a std::deque takes a 512-byte block every 64 requests (3 in
// 200); before the reuse it was 18-20 allocations per call on the one-exchange path, and 6 on the
// chunk path before its run kept its plan (Engine::run_allreduces).
enum class SmallPath { kRecords, kChunks, kTuned };
static void test_small_allreduce_allocates_nothing(SmallPath mode) {
  const int ranks = 2;
  const std::string name = "/dev/shm/fastxfer-test-core-alloc-" + std::to_string(getpid());
  const char* path = mode == SmallPath::kRecords ? "the one-exchange path"
                     : mode == SmallPath::kChunks ? "the chunk path"
                                                  : "the tuner's paths";
  std::fflush(stdout);
  std::vector<pid_t> kids;
  for (int r = 0; r < ranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 0;
      try {
        JobConfig job;
        job.shm.name = name;
        job.shm.rank = r;
        job.shm.size = ranks;
        job.shm.window_bytes = 1u << 20;
        job.shm.oob_bytes = 4096;
        job.shm.max_records = 64;
        job.shm.timeout_s = 60;
        job.shm.attach_timeout_s = 60;
        job.engine.max_records = 64;
        if (mode == SmallPath::kRecords) job.engine.eager_tune = false;
        if (mode == SmallPath::kChunks) job.engine.eager_bytes = 0;
        std::shared_ptr<Engine> eng = start_engine(job, nullptr);
        std::vector<float> in(1024), out(1024);
        long counted = 0;
        int wrong = 0;
        for (int i = 0; i < 300; ++i) {
          for (size_t k = 0; k < in.size(); ++k) in[k] = static_cast<float>((k + i) % 7 + 2 * r);
          RequestSpec spec;  // before the count: the caller's side, as the binding keeps one
          spec.kind = CollectiveKind::kAllreduce;
          spec.name = "a";
          spec.shape = {1024};
          spec.has_data = true;
          spec.op = ReduceOp::kAverage;
          spec.in = in.data();
          spec.out = out.data();
          Request req = build_request(spec, *eng);
          req.tracked = false;
          const long before = g_news.load();
          const uint64_t id = eng->submit(std::move(req), true);
          eng->wait(id);
          eng->release(id);
          if (i >= 100) counted += g_news.load() - before;
          for (size_t k = 0; k < in.size(); ++k)  // (x + x + 2) / 2 over the two ranks
            wrong += out[k] != static_cast<float>((k + i) % 7 + 1);
        }
        const long allowed = 200 / 64 + 1;
        if (counted > allowed)
          std::printf("rank %d, %s: %ld allocations in 200 allreduces (at most %ld)\n", r, path, counted, allowed);
        if (wrong != 0) std::printf("rank %d, %s: %d wrong elements\n", r, path, wrong);
        bool both = true;  // the tuner's trial rounds ran each path inside the count
        if (mode == SmallPath::kTuned) {
          const auto rows = eng->eager_tuning();
          both = rows.size() == 1 && rows[0].eager_rounds > 0 && rows[0].chunk_rounds > 0;
          if (!both) std::printf("rank %d: the tuner did not run both paths in 300 calls\n", r);
        }
        rc = counted > allowed || wrong != 0 || !both;
        eng->shutdown();
      } catch (const std::exception& e) {
        std::printf("rank %d: %s\n", r, e.what());
        rc = 1;
      }
      std::fflush(stdout);
      _exit(rc);
    }
    kids.push_back(pid);
  }
  int failed = 0;
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  CHECK(failed == 0, "%d of %d ranks allocated in a warm small allreduce on %s, or got a wrong result", failed, ranks,
        path);
  unlink(name.c_str());
}

// What _core.configure does at import (fastxfer/settings.py reads the environment, not the core).
static void test_process_settings() {
  const int mask = default_threads();
  CHECK(mask >= 1, "default threads %d", mask);
  set_default_threads(3);
  CHECK(default_threads() == 3, "set_default_threads(3) gave %d", default_threads());
  set_default_threads(0);
  CHECK(default_threads() == mask, "set_default_threads(0) gave %d, not the mask's %d", default_threads(), mask);
  const SimdLevel best = best_simd_level();
  set_simd_level(SimdLevel::kScalar);
  CHECK(active_simd_level() == SimdLevel::kScalar, "scalar level not applied");
  set_simd_level(best);
  const size_t cap = pool_stats().cap_bytes;
  pool_set_cap(size_t(1) << 20);
  void* p = pool_acquire(size_t(2) << 20);  // larger than the cap: never cached
  pool_release(p, 0);
  CHECK(pool_stats().cap_bytes == (size_t(1) << 20) && pool_stats().cached_bytes == 0, "pool cap not applied");
  pool_set_cap(cap);
}

// The one-exchange path's tuner (engine/eager_tuner.h): the offer before and after its warm-up,
// trials the same for every rank (from the round number alone), medians that decide both ways,
// and off meaning every offer.
static void test_eager_tuner() {
  using T = EagerTuner;
  CHECK(T::size_class(1) == 0 && T::size_class(4096) == 12 && T::size_class(4097) == 13 &&
            T::size_class(65536) == 16 && T::size_class(1 << 20) == 16, "size classes");
  int eager_trials = 0, chunk_trials = 0;
  for (uint64_t r = 0; r < 32000; ++r) {
    eager_trials += T::trial(r) == T::Trial::kEager;
    chunk_trials += T::trial(r) == T::Trial::kChunks;
  }
  CHECK(eager_trials > 800 && eager_trials < 1200 && chunk_trials > 800 && chunk_trials < 1200, "trials 1 in 32 each");
  uint64_t none = 0;  // a round without a trial, and one of each kind
  while (T::trial(none) != T::Trial::kNone) ++none;
  uint64_t chunk_round = 0, eager_round = 0;
  while (T::trial(chunk_round) != T::Trial::kChunks) ++chunk_round;
  while (T::trial(eager_round) != T::Trial::kEager) ++eager_round;
  T t;
  const size_t b = 16 << 10;
  CHECK(!t.enabled(), "the tuner is on by default");
  t.set_enabled(true);
  for (uint64_t k = 0; k < T::kWarmup; ++k) CHECK(t.offer(b, chunk_round), "an offer refused in the warm-up");
  CHECK(!t.offer(b, chunk_round) && t.offer(b, eager_round) && t.offer(b, none), "trials after the warm-up");
  // the chunks twice as fast: after kMinSamples of each, the preferred path is the chunks
  for (int k = 0; k < T::kMinSamples; ++k) t.record(b, true, 10e-6);
  for (int k = 0; k < T::kMinSamples - 1; ++k) t.record(b, false, 5e-6);
  CHECK(t.offer(b, none), "decided before the chunks had kMinSamples rounds");
  t.record(b, false, 5e-6);
  CHECK(!t.offer(b, none) && t.offer(b, eager_round), "the faster chunks not preferred, or no eager trial");
  // one slow outlier among the chunks does not move the median; a window of faster eager rounds does
  t.record(b, false, 1.0);
  CHECK(!t.offer(b, none), "one outlier moved the choice");
  for (int k = 0; k < T::kWindow; ++k) t.record(b, true, 2e-6);
  CHECK(t.offer(b, none), "eager rounds now faster, still not preferred");
  auto rows = t.rows();
  CHECK(rows.size() == 1 && rows[0].bytes == b && rows[0].eager_rounds == T::kMinSamples + T::kWindow &&
            rows[0].chunk_rounds == T::kMinSamples + 1 && rows[0].eager_median_s == 2e-6 &&
            rows[0].chunk_median_s == 5e-6 && rows[0].prefer_eager,
        "rows");
  // another class keeps its own state; off: every offer, nothing recorded
  CHECK(t.offer(1024, chunk_round), "a new class in its warm-up refused");
  t.set_enabled(false);
  for (int k = 0; k < 3 * T::kWindow; ++k) t.record(b, false, 1e-9);
  CHECK(t.offer(b, chunk_round) && t.rows()[1].chunk_rounds == T::kMinSamples + 1, "off still tuned");
}

int main() {
  test_wait_spin_adapts_on_own_result_waits();
  test_small_allreduce_allocates_nothing(SmallPath::kRecords);
  test_small_allreduce_allocates_nothing(SmallPath::kChunks);
  test_small_allreduce_allocates_nothing(SmallPath::kTuned);
  test_counter_increment_loses_nothing();
  test_segment_ranks_attaching_together();
  test_process_settings();
  test_net_lane_interrupt();
  test_heartbeat();
  test_kernels_match_reference();
  test_pack_ranges_roundtrip();
  test_planner_invariants();
  test_reduce_block();
  test_16bit_reduce_matches_reference();
  test_cpu_lists();
  test_eager_tuner();
  if (failures) {
    std::printf("%d failed\n", failures);
    return 1;
  }
  std::printf("all C++ core tests passed\n");
  return 0;
}
