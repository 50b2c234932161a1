// NativeMPIInterHost: the inter-host link on MPI's C API, found at run time (mpi_native.h).
#include "transport/mpi_native.h"

#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>
#include <type_traits>

#include "common/errors.h"
#include "kernels/reduce.h"

namespace fastxfer {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr size_t kMaxMessage = size_t{1} << 30;  // MPI counts are ints: larger buffers go in pieces
constexpr size_t kStatusBytes = 64;               // MPI_Status is 20 bytes (MPICH) or 24 (Open MPI)

// Tags: calls on one communicator run one at a time, in the same order on every rank, so a tag
// only has to tell apart the steps of one call.
enum Tag : int { kShard = 11, kScatter = 12, kGather = 13, kBytes = 21, kBcast = 31, kAllgatherv = 41,
                 kAlltoallv = 51, kOobWhat = 61 };

// Scratch buffers MPI receives into. If a call gives up (a host was lost) a receive may still be
// pending inside MPI after MPI_Cancel, so the buffer is then left allocated rather than freed
// under it: the engine is going down anyway.
struct Scratch {
  explicit Scratch(size_t n) : v(new std::vector<char>(n)) {}
  ~Scratch() {
    if (std::uncaught_exceptions() == 0) delete v;
  }
  char* data() { return v->data(); }
  std::vector<char>* v;
};

// Between two polls of a wait that has lasted `waited` seconds: nothing while it spins, then a
// yield of the core (a peer or the training thread may need it; a yield with nothing else to run
// returns at once, where the shortest sleep costs the timer slack, ~50 us), and only after
// kYieldS sleeps growing to 0.1 ms (a wait that long is a peer computing, not the network).
constexpr double kYieldS = 2e-3;
void pause(double waited, double spin, long& sleep_ns) {
  if (waited <= spin) return;
  if (waited <= spin + kYieldS) {
    std::this_thread::yield();
    return;
  }
  struct timespec ts = {0, sleep_ns};
  nanosleep(&ts, nullptr);
  sleep_ns = std::min<long>(sleep_ns * 2, 100000);
}

}  // namespace

// The C API with this process's ABI: function pointers and the constants the code needs.
class NativeMPI {
 public:
  virtual ~NativeMPI() = default;
  virtual size_t request_bytes() const = 0;
  virtual int isend(const void* buf, int count, int dest, int tag, uintptr_t comm, void* req) = 0;
  virtual int irecv(void* buf, int count, int src, int tag, uintptr_t comm, void* req) = 0;
  virtual int iprobe(int src, int tag, uintptr_t comm, int* flag, void* status) = 0;
  virtual int get_count(const void* status, int* count) = 0;
  virtual int testall(int n, void* reqs, int* flag) = 0;
  virtual void cancel_and_free(void* req) = 0;  // best effort, for a call that gives up
  virtual std::string error(int code) = 0;
};

namespace {

template <class F>
F lookup(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (p == nullptr)
    throw EngineError(std::string("fastxfer's native MPI transport: the loaded MPI library has no ") + name);
  return reinterpret_cast<F>(p);
}

// H: how the ABI represents a communicator or datatype; R: a request. Open MPI: pointers to its
// objects; the MPICH family: ints.
template <class H, class R>
class MPIAbi : public NativeMPI {
 public:
  MPIAbi(void* lib, H byte, void* statuses_ignore, R request_null)
      : byte_(byte), statuses_ignore_(statuses_ignore), null_(request_null) {
    isend_ = lookup<decltype(isend_)>(lib, "MPI_Isend");
    irecv_ = lookup<decltype(irecv_)>(lib, "MPI_Irecv");
    iprobe_ = lookup<decltype(iprobe_)>(lib, "MPI_Iprobe");
    get_count_ = lookup<decltype(get_count_)>(lib, "MPI_Get_count");
    testall_ = lookup<decltype(testall_)>(lib, "MPI_Testall");
    cancel_ = lookup<decltype(cancel_)>(lib, "MPI_Cancel");
    free_ = lookup<decltype(free_)>(lib, "MPI_Request_free");
    error_string_ = lookup<decltype(error_string_)>(lib, "MPI_Error_string");
  }
  size_t request_bytes() const override { return sizeof(R); }
  int isend(const void* buf, int count, int dest, int tag, uintptr_t comm, void* req) override {
    return isend_(buf, count, byte_, dest, tag, handle(comm), static_cast<R*>(req));
  }
  int irecv(void* buf, int count, int src, int tag, uintptr_t comm, void* req) override {
    return irecv_(buf, count, byte_, src, tag, handle(comm), static_cast<R*>(req));
  }
  int iprobe(int src, int tag, uintptr_t comm, int* flag, void* status) override {
    return iprobe_(src, tag, handle(comm), flag, status);
  }
  int get_count(const void* status, int* count) override { return get_count_(status, byte_, count); }
  int testall(int n, void* reqs, int* flag) override {
    return testall_(n, static_cast<R*>(reqs), flag, statuses_ignore_);
  }
  void cancel_and_free(void* req) override {
    R* r = static_cast<R*>(req);
    if (*r == null_) return;
    cancel_(r);
    free_(r);
  }
  std::string error(int code) override {
    char msg[1024] = {};
    int len = 0;
    if (error_string_(code, msg, &len) != 0) return "MPI error " + std::to_string(code);
    return std::string(msg, static_cast<size_t>(std::max(0, std::min(len, 1023))));
  }

 private:
  static H handle(uintptr_t v) {
    if constexpr (std::is_pointer_v<H>) {
      return reinterpret_cast<H>(v);
    } else {
      return static_cast<H>(static_cast<uint32_t>(v));
    }
  }
  H byte_;
  void* statuses_ignore_;
  R null_;
  int (*isend_)(const void*, int, H, int, int, H, R*) = nullptr;
  int (*irecv_)(void*, int, H, int, int, H, R*) = nullptr;
  int (*iprobe_)(int, int, H, int*, void*) = nullptr;
  int (*get_count_)(const void*, H, int*) = nullptr;
  int (*testall_)(int, R*, int*, void*) = nullptr;
  int (*cancel_)(R*) = nullptr;
  int (*free_)(R*) = nullptr;
  int (*error_string_)(int, char*, int*) = nullptr;
};

std::shared_ptr<NativeMPI> open_mpi_api(const NativeMPIConfig& cfg) {
  void* lib = dlopen(cfg.library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr)
    throw EngineError("fastxfer's native MPI transport: " + cfg.library + " is not loaded (import mpi4py.MPI first)");
  // dlsym on the handle searches the object and everything it depends on (libmpi); the library
  // stays loaded as long as mpi4py does, and this handle keeps it so.
  if (cfg.family == "openmpi") {
    void* byte = dlsym(lib, "ompi_mpi_byte");
    void* null = dlsym(lib, "ompi_request_null");
    if (byte == nullptr || null == nullptr)
      throw EngineError("fastxfer's native MPI transport: mpi4py reports Open MPI, but its library has no "
                        "ompi_mpi_byte / ompi_request_null (set FASTXFER_NATIVE_MPI=0 to use mpi4py)");
    return std::make_shared<MPIAbi<void*, void*>>(lib, byte, nullptr, null);
  }
  if (cfg.family == "mpich") {
    // MPICH's mpi.h: MPI_BYTE 0x4c00010d, MPI_STATUSES_IGNORE (MPI_Status *)1, MPI_REQUEST_NULL
    // 0x2c000000 (Intel MPI and MVAPICH keep MPICH's ABI).
    return std::make_shared<MPIAbi<int, int>>(lib, static_cast<int>(0x4c00010d), reinterpret_cast<void*>(1),
                                              static_cast<int>(0x2c000000));
  }
  throw EngineError("fastxfer's native MPI transport does not know the ABI family '" + cfg.family + "'");
}

}  // namespace

struct NativeMPIInterHost::Op {
  bool send;
  int peer;
  int tag;
  char* buf;
  size_t bytes;
};

NativeMPIInterHost::NativeMPIInterHost(const NativeMPIConfig& cfg) : cfg_(cfg), mpi_(open_mpi_api(cfg)) {
  if (cfg_.size < 1 || cfg_.rank < 0 || cfg_.rank >= cfg_.size || cfg_.cross_size < 1 || cfg_.cross_rank < 0 ||
      cfg_.cross_rank >= cfg_.cross_size)
    throw std::invalid_argument("native MPI transport: bad ranks");
}

NativeMPIInterHost::~NativeMPIInterHost() = default;

void NativeMPIInterHost::interrupt(const std::string& why) {
  std::lock_guard<std::mutex> lk(why_mu_);
  if (interrupted_.load()) return;  // the first reason stands (a lost host, then the engine stopping)
  why_ = why;
  interrupted_.store(true);
}

void NativeMPIInterHost::set_local_watch(std::function<void()> check) {
  std::lock_guard<std::mutex> lk(watch_mu_);
  watch_ = std::move(check);
}

void NativeMPIInterHost::watch(double waited, double& next) {
  constexpr double kWatchS = 1e-3;
  if (waited <= cfg_.spin_us * 1e-6 || waited < next) return;
  next = waited + kWatchS;
  std::lock_guard<std::mutex> lk(watch_mu_);
  if (watch_) watch_();
}

void NativeMPIInterHost::cancel(char* reqs, size_t n) {
  for (size_t i = 0; i < n; ++i) mpi_->cancel_and_free(reqs + i * mpi_->request_bytes());
}

void NativeMPIInterHost::between_polls(double start, double& next_watch, long& sleep_ns, char* reqs, size_t n) {
  if (interrupted_.load()) {
    cancel(reqs, n);
    std::lock_guard<std::mutex> lk(why_mu_);
    throw PeerFailure(why_);
  }
  const double waited = now_s() - start;
  try {
    watch(waited, next_watch);
  } catch (...) {
    cancel(reqs, n);
    throw;
  }
  pause(waited, cfg_.spin_us * 1e-6, sleep_ns);
}

void NativeMPIInterHost::run(uintptr_t comm, std::vector<Op>& ops, const char* what) {
  // Split every operation into pieces MPI's int counts can carry; same tag, so they match in order.
  const size_t rb = mpi_->request_bytes();
  size_t count = 0;
  for (const Op& o : ops) count += std::max<size_t>(1, (o.bytes + kMaxMessage - 1) / kMaxMessage);
  std::vector<char> reqs(count * rb);
  size_t k = 0;
  for (const Op& o : ops) {
    size_t off = 0;
    do {
      const size_t n = std::min(kMaxMessage, o.bytes - off);
      void* req = reqs.data() + k * rb;
      const int rc = o.send ? mpi_->isend(o.buf + off, static_cast<int>(n), o.peer, o.tag, comm, req)
                            : mpi_->irecv(o.buf + off, static_cast<int>(n), o.peer, o.tag, comm, req);
      if (rc != 0) {
        cancel(reqs.data(), k);
        throw EngineError(std::string(what) + ": MPI_" + (o.send ? "Isend to" : "Irecv from") + " rank " +
                          std::to_string(o.peer) + " failed: " + mpi_->error(rc));
      }
      ++k;
      off += n;
    } while (off < o.bytes);
  }
  const double start = now_s();
  long sleep_ns = 2000;
  double next_watch = 0;
  for (;;) {
    int done = 0;
    const int rc = mpi_->testall(static_cast<int>(count), reqs.data(), &done);
    if (rc != 0) throw EngineError(std::string(what) + ": MPI_Testall failed: " + mpi_->error(rc));
    if (done) return;
    between_polls(start, next_watch, sleep_ns, reqs.data(), count);
  }
}

std::vector<std::vector<char>> NativeMPIInterHost::gather_any(uintptr_t comm, int me, int n,
                                                              const std::vector<char>& mine, int tag,
                                                              const char* what) {
  // Every rank sends its bytes to every other; a receiver learns each size by probing.
  if (mine.size() > kMaxMessage) throw std::invalid_argument(std::string(what) + ": over 1 GiB");
  std::vector<std::vector<char>> all(static_cast<size_t>(n));
  all[static_cast<size_t>(me)] = mine;
  std::vector<Op> sends;
  for (int j = 0; j < n; ++j)
    if (j != me) sends.push_back({true, j, tag, const_cast<char*>(mine.data()), mine.size()});
  // Post the sends, then receive each peer's message as it shows up, then finish the sends.
  const size_t rb = mpi_->request_bytes();
  std::vector<char> sreq(sends.size() * rb);
  for (size_t i = 0; i < sends.size(); ++i) {
    const int rc = mpi_->isend(sends[i].buf, static_cast<int>(sends[i].bytes), sends[i].peer, tag, comm,
                               sreq.data() + i * rb);
    if (rc != 0) {
      cancel(sreq.data(), i);
      throw EngineError(std::string(what) + ": MPI_Isend failed: " + mpi_->error(rc));
    }
  }
  std::vector<bool> got(static_cast<size_t>(n), false);
  got[static_cast<size_t>(me)] = true;
  int left = n - 1;
  const double start = now_s();
  long sleep_ns = 2000;
  double next_watch = 0;
  alignas(16) char status[kStatusBytes];
  while (left > 0) {
    bool progress = false;
    for (int j = 0; j < n; ++j) {
      if (got[static_cast<size_t>(j)]) continue;
      int flag = 0;
      std::memset(status, 0, sizeof status);
      int rc = mpi_->iprobe(j, tag, comm, &flag, status);
      if (rc != 0) throw EngineError(std::string(what) + ": MPI_Iprobe failed: " + mpi_->error(rc));
      if (!flag) continue;
      int bytes = 0;
      rc = mpi_->get_count(status, &bytes);
      if (rc != 0 || bytes < 0) throw EngineError(std::string(what) + ": MPI_Get_count failed: " + mpi_->error(rc));
      all[static_cast<size_t>(j)].resize(static_cast<size_t>(bytes));
      std::vector<Op> one{{false, j, tag, all[static_cast<size_t>(j)].data(), static_cast<size_t>(bytes)}};
      run(comm, one, what);  // it is there: completes at once
      got[static_cast<size_t>(j)] = true;
      --left;
      progress = true;
    }
    if (progress || left == 0) continue;
    between_polls(start, next_watch, sleep_ns, sreq.data(), sends.size());
  }
  for (;;) {  // the sends (their receivers have matched them; they end at once or soon)
    int done = 0;
    const int rc = mpi_->testall(static_cast<int>(sends.size()), sreq.data(), &done);
    if (rc != 0) throw EngineError(std::string(what) + ": MPI_Testall failed: " + mpi_->error(rc));
    if (done) break;
    between_polls(start, next_watch, sleep_ns, sreq.data(), sends.size());
  }
  return all;
}

void NativeMPIInterHost::reduce_across(uintptr_t comm, int me, int n, void* buf, size_t count, DType dtype,
                                       ReduceOp op, const char* what) {
  if (n == 1 || count == 0) return;
  if (op == ReduceOp::kAdasum) throw std::invalid_argument("Adasum does not reduce shards across hosts");
  const ReduceOp rop = op == ReduceOp::kAverage ? ReduceOp::kSum : op;  // the caller scales once
  const size_t es = dtype_size(dtype);
  const size_t bytes = count * es;
  char* mine = static_cast<char*>(buf);
  if (bytes * static_cast<size_t>(n - 1) <= cfg_.small_bytes || count < static_cast<size_t>(n)) {
    // One round: every rank sends its whole buffer to every other and adds all of them in rank
    // order (latency: one message time; the same bits everywhere). It sends (n-1) x the buffer
    // where the two-round form sends 2(n-1)/n x: the same on 2 hosts, more on 3 or more, so the
    // limit is on what it sends.
    Scratch others(bytes * static_cast<size_t>(n - 1));
    std::vector<Op> ops;
    std::vector<const void*> srcs(static_cast<size_t>(n));
    for (int j = 0, slot = 0; j < n; ++j) {
      if (j == me) {
        srcs[static_cast<size_t>(j)] = mine;
        continue;
      }
      char* into = others.data() + bytes * static_cast<size_t>(slot++);
      srcs[static_cast<size_t>(j)] = into;
      ops.push_back({false, j, kShard, into, bytes});
      ops.push_back({true, j, kShard, mine, bytes});
    }
    run(comm, ops, what);
    reduce_block(rop, dtype, srcs.data(), n, mine, count, 1.0);
    return;
  }
  // Reduce-scatter then allgather: rank j reduces piece j of every rank's buffer (in rank order)
  // and sends the result back to all. Each rank sends 2(n-1)/n of the buffer: the ring's optimum.
  std::vector<size_t> counts(static_cast<size_t>(n)), starts(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) counts[j] = count / n + (static_cast<size_t>(j) < count % n ? 1 : 0);
  for (int j = 1; j < n; ++j) starts[j] = starts[j - 1] + counts[j - 1];
  const size_t k = counts[static_cast<size_t>(me)];
  Scratch pieces(k * es * static_cast<size_t>(n - 1));
  std::vector<Op> ops;
  std::vector<const void*> srcs(static_cast<size_t>(n));
  char* my_piece = mine + starts[static_cast<size_t>(me)] * es;
  for (int j = 0, slot = 0; j < n; ++j) {
    if (j == me) {
      srcs[static_cast<size_t>(j)] = my_piece;
      continue;
    }
    char* into = pieces.data() + k * es * static_cast<size_t>(slot++);
    srcs[static_cast<size_t>(j)] = into;
    ops.push_back({false, j, kScatter, into, k * es});
    ops.push_back({true, j, kScatter, mine + starts[j] * es, counts[j] * es});
  }
  run(comm, ops, what);
  reduce_block(rop, dtype, srcs.data(), n, my_piece, k, 1.0);
  ops.clear();
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ops.push_back({false, j, kGather, mine + starts[j] * es, counts[j] * es});
    ops.push_back({true, j, kGather, my_piece, k * es});
  }
  run(comm, ops, what);
}

void NativeMPIInterHost::allreduce_shard(void* buf, size_t n, DType dtype, ReduceOp op) {
  reduce_across(cfg_.cross, cfg_.cross_rank, cfg_.cross_size, buf, n, dtype, op, "allreduce across hosts");
}

std::vector<std::vector<char>> NativeMPIInterHost::allgather_bytes_across(const std::vector<char>& mine) {
  return gather_any(cfg_.cross, cfg_.cross_rank, cfg_.cross_size, mine, kBytes, "agreement round across hosts");
}

std::vector<std::vector<char>> NativeMPIInterHost::allgather_bytes(const std::vector<char>& mine) {
  return gather_any(cfg_.world, cfg_.rank, cfg_.size, mine, kBytes, "agreement round across hosts");
}

void NativeMPIInterHost::broadcast(void* buf, size_t nbytes, int root) {
  // A binomial tree rooted at `root`: log2(size) message times.
  const int n = cfg_.size;
  if (n == 1 || nbytes == 0) return;
  const int rel = (cfg_.rank - root + n) % n;
  char* p = static_cast<char*>(buf);
  int mask = 1;
  while (mask < n) {
    if (rel & mask) {
      std::vector<Op> one{{false, (rel - mask + root) % n, kBcast, p, nbytes}};
      run(cfg_.world, one, "broadcast across hosts");
      break;
    }
    mask <<= 1;
  }
  std::vector<Op> sends;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (rel + mask < n) sends.push_back({true, (rel + mask + root) % n, kBcast, p, nbytes});
  if (!sends.empty()) run(cfg_.world, sends, "broadcast across hosts");
}

void NativeMPIInterHost::allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) {
  const int n = cfg_.size, me = cfg_.rank;
  char* o = static_cast<char*>(out);
  std::vector<size_t> at(static_cast<size_t>(n) + 1, 0);
  for (int j = 0; j < n; ++j) at[j + 1] = at[j] + bytes[j];
  if (bytes[me] > 0) std::memmove(o + at[me], in, bytes[me]);
  std::vector<Op> ops;
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    if (bytes[j] > 0) ops.push_back({false, j, kAllgatherv, o + at[j], bytes[j]});
    if (bytes[me] > 0) ops.push_back({true, j, kAllgatherv, o + at[me], bytes[me]});
  }
  run(cfg_.world, ops, "allgather across hosts");
}

void NativeMPIInterHost::alltoallv(const void* in, void* out, const std::vector<size_t>& send_bytes,
                                   const std::vector<size_t>& recv_bytes) {
  const int n = cfg_.size, me = cfg_.rank;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  size_t so = 0, ro = 0;
  std::vector<Op> ops;
  for (int j = 0; j < n; ++j) {
    if (j == me) {
      if (send_bytes[j] > 0) std::memcpy(dst + ro, src + so, send_bytes[j]);
    } else {
      if (recv_bytes[j] > 0) ops.push_back({false, j, kAlltoallv, dst + ro, recv_bytes[j]});
      if (send_bytes[j] > 0) ops.push_back({true, j, kAlltoallv, const_cast<char*>(src + so), send_bytes[j]});
    }
    so += send_bytes[j];
    ro += recv_bytes[j];
  }
  run(cfg_.world, ops, "alltoall across hosts");
}

void NativeMPIInterHost::oob_allreduce(const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                                       const std::string& what) {
  const auto whats = gather_any(cfg_.oob, cfg_.rank, cfg_.size, std::vector<char>(what.begin(), what.end()),
                                kOobWhat, "oob_allreduce across hosts");
  for (int j = 1; j < cfg_.size; ++j)
    if (whats[j] != whats[0])
      throw Mismatch("oob_allreduce: rank 0 submitted " + std::string(whats[0].begin(), whats[0].end()) +
                     " but rank " + std::to_string(j) + " submitted " + std::string(whats[j].begin(), whats[j].end()));
  if (out != in) std::memcpy(out, in, n * dtype_size(dtype));
  reduce_across(cfg_.oob, cfg_.rank, cfg_.size, out, n, dtype, op, "oob_allreduce across hosts");
}

}  // namespace fastxfer
