// Shared-memory transport. Layout of the segment:
//
//   [Header][rank 0: Control | records x2 | oob slot | window (2 halves)][rank 1: ...]...
//
// Every rank writes only its own area; it reads the others'. Progress is published through
// monotonically increasing counters in Control, one per phase, so "rank j has finished phase p of
// chunk g" is simply counter_p(j) >= g + 1. See docs/algorithms.md for the steps and bytes.
#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "compress/kernels.h"
#include "engine/reduce.h"
#include "fusion/pack.h"

namespace fastxfer {

namespace {

constexpr uint64_t kMagic = 0x31766d6873786678ull;  // "xfxshmv1"
constexpr size_t kPage = 4096;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string errno_str(int e) { return std::string(std::strerror(e)); }

}  // namespace

struct ShmTransport::Header {
  std::atomic<uint64_t> magic;  // written last by the creator
  int32_t size;
  int32_t max_records;
  uint64_t window_bytes;
  uint64_t oob_bytes;
  shm::Counter attached;
};

struct ShmTransport::Control {
  shm::Counter ready;     // chunk packed into my window half
  shm::Counter reduced;   // my shard of the chunk reduced (allreduce)
  shm::Counter consumed;  // I have read everything I need from everyone's half
  shm::Counter round;     // my records for this negotiation round are published
  shm::Counter oob_ready;
  shm::Counter oob_consumed;
  alignas(64) shm::ProcessId pid;
  std::atomic<int32_t> state;  // 0 attaching, 1 running, 2 left cleanly, 3 failed
  char why[240];
};

ShmTransport::Control& ShmTransport::ctl(int j) const {
  return *reinterpret_cast<Control*>(static_cast<char*>(base_) + header_bytes_ + j * stride_ + ctl_off_);
}
Record* ShmTransport::records(int j, int buf) const {
  char* p = static_cast<char*>(base_) + header_bytes_ + j * stride_ + rec_off_;
  return reinterpret_cast<Record*>(p + 64 + static_cast<size_t>(buf) * cfg_.max_records * sizeof(Record));
}
uint32_t* ShmTransport::record_count(int j, int buf) const {
  char* p = static_cast<char*>(base_) + header_bytes_ + j * stride_ + rec_off_;
  return reinterpret_cast<uint32_t*>(p) + buf;
}
char* ShmTransport::oob(int j) const { return static_cast<char*>(base_) + header_bytes_ + j * stride_ + oob_off_; }
char* ShmTransport::window(int j, int half) const {
  return static_cast<char*>(base_) + header_bytes_ + j * stride_ + win_off_ + half * (cfg_.window_bytes / 2);
}

ShmTransport::ShmTransport(const ShmConfig& cfg) : cfg_(cfg) {
  if (cfg_.size < 1 || cfg_.rank < 0 || cfg_.rank >= cfg_.size)
    throw std::invalid_argument("bad rank " + std::to_string(cfg_.rank) + " of " + std::to_string(cfg_.size));
  cfg_.window_bytes = round_up(std::max<size_t>(cfg_.window_bytes, 2 * kPage), 2 * kPage);
  // A chunk must hold one 64-byte-aligned shard per rank for every dtype pair (float32 values on a
  // 16-bit wire are the tightest: 32 elements of 4 bytes per rank).
  if (cfg_.window_bytes / 2 < static_cast<size_t>(cfg_.size) * 128)
    throw std::invalid_argument("shared-memory window too small for " + std::to_string(cfg_.size) +
                                " ranks: at least " + std::to_string(cfg_.size * 256) + " bytes");
  cfg_.oob_bytes = round_up(std::max<size_t>(cfg_.oob_bytes, kPage), kPage);
  if (cfg_.max_records < 1) cfg_.max_records = 1;

  header_bytes_ = round_up(sizeof(Header), kPage);
  ctl_off_ = 0;
  rec_off_ = round_up(sizeof(Control), kPage);
  oob_off_ = rec_off_ + round_up(64 + 2 * static_cast<size_t>(cfg_.max_records) * sizeof(Record), kPage);
  win_off_ = oob_off_ + cfg_.oob_bytes;
  stride_ = win_off_ + cfg_.window_bytes;
  total_ = header_bytes_ + stride_ * cfg_.size;

  const bool creator = cfg_.rank == 0;
  double deadline = now_s() + cfg_.attach_timeout_s;
  if (creator) {
    fd_ = shm_open(cfg_.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd_ < 0)
      throw EngineError("cannot create shared-memory segment " + cfg_.name + ": " + errno_str(errno) +
                        (errno == EEXIST ? " (another job uses this job id; each job needs its own)" : ""));
    if (ftruncate(fd_, static_cast<off_t>(total_)) != 0) {
      int e = errno;
      shm_unlink(cfg_.name.c_str());
      throw EngineError("cannot size shared-memory segment to " + std::to_string(total_) + " bytes: " +
                        errno_str(e) + " (is /dev/shm large enough?)");
    }
  } else {
    for (;;) {
      fd_ = shm_open(cfg_.name.c_str(), O_RDWR, 0600);
      if (fd_ >= 0) {
        struct stat st;
        if (fstat(fd_, &st) == 0 && static_cast<size_t>(st.st_size) == total_) break;
        if (fstat(fd_, &st) == 0 && st.st_size != 0 && static_cast<size_t>(st.st_size) != total_) {
          close(fd_);
          throw Mismatch("ranks disagree on the job layout: the shared-memory segment has " +
                         std::to_string(st.st_size) + " bytes, this rank expects " + std::to_string(total_) +
                         " (same size, window and oob settings on every rank?)");
        }
        close(fd_);
        fd_ = -1;
      } else if (errno != ENOENT) {
        throw EngineError("cannot open shared-memory segment " + cfg_.name + ": " + errno_str(errno));
      }
      if (now_s() > deadline)
        throw PeerFailure("rank " + std::to_string(cfg_.rank) + " did not find the job's shared memory within " +
                          std::to_string(static_cast<int>(cfg_.attach_timeout_s)) +
                          " s: rank 0 never started, or the ranks are not on one host (several hosts need MPI: "
                          "pip install 'fastxfer[mpi]' and launch with fastxfer run --hosts or mpirun)");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  base_ = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    int e = errno;
    if (creator) shm_unlink(cfg_.name.c_str());
    close(fd_);
    throw EngineError("cannot map shared memory: " + errno_str(e));
  }
  try {
    attach(creator, deadline);
  } catch (...) {
    // Leave nothing behind: the peers see the segment vanish (creator) or this rank never attach.
    if (creator) shm_unlink(cfg_.name.c_str());
    munmap(base_, total_);
    base_ = nullptr;
    close(fd_);
    fd_ = -1;
    throw;
  }
}

void ShmTransport::attach(bool creator, double deadline) {
  auto* h = static_cast<Header*>(base_);
  if (creator) {
    h->size = cfg_.size;
    h->max_records = cfg_.max_records;
    h->window_bytes = cfg_.window_bytes;
    h->oob_bytes = cfg_.oob_bytes;
    h->magic.store(kMagic, std::memory_order_release);
  } else {
    while (h->magic.load(std::memory_order_acquire) != kMagic) {
      if (now_s() > deadline) throw PeerFailure("rank 0 created the shared memory but never initialised it");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (h->size != cfg_.size || h->max_records != cfg_.max_records || h->window_bytes != cfg_.window_bytes ||
        h->oob_bytes != cfg_.oob_bytes)
      throw Mismatch("ranks disagree on the job layout: rank 0 has size=" + std::to_string(h->size) +
                     " window=" + std::to_string(h->window_bytes) + ", rank " + std::to_string(cfg_.rank) +
                     " has size=" + std::to_string(cfg_.size) + " window=" + std::to_string(cfg_.window_bytes));
  }
  Control& me = ctl(cfg_.rank);
  me.pid = shm::self_process_id();
  me.state.store(1, std::memory_order_release);
  uint32_t n = h->attached.value.fetch_add(1, std::memory_order_acq_rel) + 1;
  shm::publish(h->attached, n);
  while (!shm::reached(h->attached.value.load(std::memory_order_acquire), static_cast<uint32_t>(cfg_.size))) {
    for (int j = 0; j < cfg_.size; ++j) {
      Control& c = ctl(j);
      if (c.state.load() >= 1 && !shm::process_alive(c.pid))
        throw PeerFailure("rank " + std::to_string(j) + " died while the job was starting");
    }
    if (now_s() > deadline)
      throw PeerFailure("only " + std::to_string(h->attached.value.load()) + " of " + std::to_string(cfg_.size) +
                        " ranks attached within " + std::to_string(static_cast<int>(cfg_.attach_timeout_s)) +
                        " s (are all ranks on one host? several hosts need MPI)");
    uint32_t seen = h->attached.value.load();
    shm::sleep_on(h->attached, seen, 50);
  }
  // Everyone has it mapped: drop the name so no crash can leave the segment behind.
  if (creator) shm_unlink(cfg_.name.c_str());
}

ShmTransport::~ShmTransport() {
  if (base_) munmap(base_, total_);
  if (fd_ >= 0) close(fd_);
}

void ShmTransport::mark_exited(bool clean, const char* why) {
  Control& me = ctl(cfg_.rank);
  if (why) {
    std::strncpy(me.why, why, sizeof(me.why) - 1);
    me.why[sizeof(me.why) - 1] = 0;
  }
  me.state.store(clean ? 2 : 3, std::memory_order_release);
  // wake anyone sleeping on my counters so they notice now, not at their next tick
  for (shm::Counter Control::*c : {&Control::ready, &Control::reduced, &Control::consumed, &Control::round,
                                   &Control::oob_ready, &Control::oob_consumed})
    shm::wake(me.*c);  // only wake: storing here could move a counter back under the engine thread
}

void ShmTransport::check_peers(int waiting_for, const char* phase, double waited_s) {
  if (aborted_.load()) throw EngineError("the engine was shut down while waiting (" + std::string(phase) + ")");
  for (int j = 0; j < cfg_.size; ++j) {
    if (j == cfg_.rank) continue;
    Control& c = ctl(j);
    int32_t st = c.state.load(std::memory_order_acquire);
    if (st == 3)
      throw PeerFailure("rank " + std::to_string(j) + " failed: " + std::string(c.why, strnlen(c.why, sizeof(c.why))));
    if (st == 2 && j == waiting_for)
      throw PeerFailure("rank " + std::to_string(j) + " has shut down while rank " + std::to_string(cfg_.rank) +
                        " still waits for it (" + phase + "): the ranks did not issue the same collectives");
    if (st != 2 && !shm::process_alive(c.pid))
      throw PeerFailure("rank " + std::to_string(j) + " (pid " + std::to_string(c.pid.pid) + ") died during " + phase);
  }
  if (waited_s > cfg_.timeout_s) {
    const Control& me = ctl(cfg_.rank);
    const Control& them = ctl(waiting_for);
    auto counters = [](const Control& c) {
      return "ready=" + std::to_string(c.ready.value.load()) + " reduced=" + std::to_string(c.reduced.value.load()) +
             " consumed=" + std::to_string(c.consumed.value.load()) + " round=" + std::to_string(c.round.value.load());
    };
    throw PeerFailure("rank " + std::to_string(waiting_for) + " did not answer within " +
                      std::to_string(static_cast<int>(cfg_.timeout_s)) + " s (" + phase +
                      "); raise FASTXFER_TIMEOUT if ranks legitimately drift apart this far [rank " +
                      std::to_string(cfg_.rank) + ": " + counters(me) + "; rank " + std::to_string(waiting_for) +
                      ": " + counters(them) + "]");
  }
}

void ShmTransport::wait_one(int j, shm::Counter Control::*which, uint32_t target, const char* phase) {
  shm::Counter& c = ctl(j).*which;
  for (int spin = 0; spin < 2000; ++spin) {
    if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  double start = now_s();
  for (;;) {
    uint32_t v = c.value.load(std::memory_order_acquire);
    if (shm::reached(v, target)) return;
    shm::sleep_on(c, v, 100);
    if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
    check_peers(j, phase, now_s() - start);
  }
}

void ShmTransport::wait_all(shm::Counter Control::*which, uint32_t target, const char* phase) {
  for (int j = 0; j < cfg_.size; ++j) wait_one(j, which, target, phase);
}

std::vector<std::vector<Record>> ShmTransport::exchange_records(const std::vector<Record>& mine) {
  if (mine.size() > static_cast<size_t>(cfg_.max_records))
    throw std::invalid_argument("too many records for one round");
  double t0 = now_s();
  int buf = static_cast<int>(round_ & 1);
  std::memcpy(records(cfg_.rank, buf), mine.data(), mine.size() * sizeof(Record));
  *record_count(cfg_.rank, buf) = static_cast<uint32_t>(mine.size());
  const uint32_t next_round = static_cast<uint32_t>(round_ + 1);
  shm::publish(ctl(cfg_.rank).round, next_round);
  wait_all(&Control::round, next_round, "negotiation");
  std::vector<std::vector<Record>> all(cfg_.size);
  for (int j = 0; j < cfg_.size; ++j) {
    uint32_t n = std::min<uint32_t>(*record_count(j, buf), cfg_.max_records);
    all[j].assign(records(j, buf), records(j, buf) + n);
  }
  // Double-buffered: a peer rewrites this buffer two rounds from now, which it can only reach
  // after every rank (us included) has published round_ + 2, i.e. finished reading this one.
  ++round_;
  ++stats_.rounds;
  stats_.negotiate += now_s() - t0;
  return all;
}

void ShmTransport::allreduce_staged(const AllreduceJob& job, const ShardHook& between) {
  const Bucket& b = *job.bucket;
  const int n_ranks = cfg_.size, me = cfg_.rank;
  const size_t es = dtype_size(b.wire_dtype);
  const size_t align = 64 / es;
  const size_t own_es = dtype_size(b.dtype);
  // Read my own contribution straight from my tensors when no pre-scaling is needed and the
  // reduction kernel has a direct form for this dtype pair.
  const bool direct = !between && job.prescale == 1.0 &&
                      ((b.dtype == b.wire_dtype && (b.dtype == DType::kFloat32 || b.dtype == DType::kFloat64)) ||
                       (b.dtype == DType::kFloat32 && b.wire_dtype != DType::kFloat32));
  // Chunk: half a window, split into one 64-byte-aligned shard per rank.
  // Chunks hold the same number of elements whatever the wire format (a compressed chunk uses
  // part of the window): the float32 inputs and outputs a chunk touches stay cache-sized.
  const size_t chunk = (cfg_.window_bytes / 2 / std::max<size_t>(es, own_es)) / (n_ranks * align) * (n_ranks * align);
  std::vector<const void*> srcs(n_ranks);
  // A large bucket's outputs go straight to memory: keeping them in cache would only evict the
  // windows and inputs this rank is still reading (about 25% faster at 64 MB on 2 ranks).
  const bool stream_big = b.numel * own_es >= cfg_.stream_min_bytes;
  ScopedStreamStores stream(stream_big);
  for (size_t lo = 0; lo < b.numel; lo += chunk) {
    const size_t hi = std::min(b.numel, lo + chunk), m = hi - lo;
    const size_t shard = (m + n_ranks * align - 1) / (n_ranks * align) * align;
    auto shard_lo = [&](int j) { return std::min(m, shard * j); };
    auto shard_hi = [&](int j) { return std::min(m, shard * (j + 1)); };
    const uint64_t seq = chunk_;
    const uint32_t g = static_cast<uint32_t>(seq);
    const int half = static_cast<int>(seq & 1);
    // 1. This half was last used two chunks ago: wait until every rank has finished reading it.
    if (seq >= 2) wait_all(&Control::consumed, g - 1, "allreduce (window reuse)");
    // 2. Pack (compress, pre-scale) the bucket straight into my window half. With `direct`, my
    //    own shard is skipped: only I read it, so step 3 takes it from my tensors instead.
    double t0 = now_s();
    char* mine = window(me, half);
    const size_t my_lo = lo + shard_lo(me), my_hi = lo + shard_hi(me);
    {
      // Packing into the window keeps normal stores: the peers read it right away.
      ScopedStreamStores cached(false);
      if (direct) {
        if (my_lo > lo) pack_range(b, job.srcs, mine, lo, my_lo, job.prescale, cfg_.threads);
        if (hi > my_hi) pack_range(b, job.srcs, mine + (my_hi - lo) * es, my_hi, hi, job.prescale, cfg_.threads);
      } else {
        pack_range(b, job.srcs, mine, lo, hi, job.prescale, cfg_.threads);
      }
    }
    double t1 = now_s();
    stats_.pack += t1 - t0;
    shm::publish(ctl(me).ready, g + 1);
    // 3. Reduce-scatter: once everyone's chunk is in, reduce my shard across all ranks (rank
    //    order 0..N-1) and write it over my own copy of that shard (and, with `direct`, into my
    //    output tensors as well).
    wait_all(&Control::ready, g + 1, "allreduce (reduce-scatter)");
    double t2 = now_s();
    stats_.wait += t2 - t1;
    if (my_lo < my_hi) {
      if (direct) {
        for (const Segment& sg : segments(b, my_lo, my_hi)) {
          for (int j = 0; j < n_ranks; ++j) srcs[j] = window(j, half) + (sg.packed - lo) * es;
          srcs[me] = static_cast<const char*>(job.srcs[sg.tensor]) + sg.begin * own_es;
          reduce_block_direct(job.op, b.wire_dtype, b.dtype, srcs.data(), n_ranks, me, mine + (sg.packed - lo) * es,
                              static_cast<char*>(job.outs[sg.tensor]) + sg.begin * own_es, sg.count, job.postscale);
        }
      } else {
        for (int j = 0; j < n_ranks; ++j) srcs[j] = window(j, half) + shard_lo(me) * es;
        reduce_block(job.op, b.wire_dtype, srcs.data(), n_ranks, mine + shard_lo(me) * es, my_hi - my_lo,
                     between ? 1.0 : job.postscale);
        if (between) between(mine + shard_lo(me) * es, my_hi - my_lo, b.wire_dtype);
      }
    }
    double t3 = now_s();
    stats_.reduce += t3 - t2;
    shm::publish(ctl(me).reduced, g + 1);
    // 4. Allgather: copy every rank's reduced shard out of its window into the output tensors
    //    (decompressing on the way), my own first unless step 3 already wrote it.
    for (int k = direct ? 1 : 0; k < n_ranks; ++k) {
      int j = (me + k) % n_ranks;
      if (shard_lo(j) >= shard_hi(j)) continue;
      double tw = now_s();
      if (j != me) wait_one(j, &Control::reduced, g + 1, "allreduce (allgather)");
      double tu = now_s();
      stats_.wait += tu - tw;
      unpack_range(b, window(j, half) + shard_lo(j) * es, job.outs, lo + shard_lo(j), lo + shard_hi(j), 1.0,
                   cfg_.threads);
      stats_.unpack += now_s() - tu;
    }
    ++stats_.chunks;
    stats_.bytes += m * es;
    shm::publish(ctl(me).consumed, g + 1);
    ++chunk_;
  }
}

void ShmTransport::broadcast(const void* in, void* out, size_t nbytes, int root) {
  const size_t half_bytes = cfg_.window_bytes / 2;
  for (size_t off = 0; off < nbytes; off += half_bytes) {
    const size_t len = std::min(half_bytes, nbytes - off);
    const uint64_t seq = chunk_;
    const uint32_t g = static_cast<uint32_t>(seq);
    const int half = static_cast<int>(seq & 1);
    if (seq >= 2) wait_all(&Control::consumed, g - 1, "broadcast (window reuse)");
    if (cfg_.rank == root) {
      std::memcpy(window(root, half), static_cast<const char*>(in) + off, len);
      if (out != in) std::memcpy(static_cast<char*>(out) + off, static_cast<const char*>(in) + off, len);
    }
    shm::publish(ctl(cfg_.rank).ready, g + 1);
    if (cfg_.rank != root) {
      wait_one(root, &Control::ready, g + 1, "broadcast");
      std::memcpy(static_cast<char*>(out) + off, window(root, half), len);
    }
    shm::publish(ctl(cfg_.rank).consumed, g + 1);
    ++chunk_;
  }
}

void ShmTransport::allgather(const void* in, void* out, const std::vector<size_t>& bytes) {
  const size_t half_bytes = cfg_.window_bytes / 2;
  std::vector<size_t> start(bytes.size() + 1, 0);
  size_t most = 0;
  for (size_t j = 0; j < bytes.size(); ++j) {
    start[j + 1] = start[j] + bytes[j];
    most = std::max(most, bytes[j]);
  }
  const int me = cfg_.rank;
  for (size_t off = 0; off < most; off += half_bytes) {
    const uint64_t seq = chunk_;
    const uint32_t g = static_cast<uint32_t>(seq);
    const int half = static_cast<int>(seq & 1);
    if (seq >= 2) wait_all(&Control::consumed, g - 1, "allgather (window reuse)");
    auto piece = [&](int j) { return off < bytes[j] ? std::min(half_bytes, bytes[j] - off) : size_t(0); };
    if (piece(me)) {
      std::memcpy(window(me, half), static_cast<const char*>(in) + off, piece(me));
      std::memcpy(static_cast<char*>(out) + start[me] + off, static_cast<const char*>(in) + off, piece(me));
    }
    shm::publish(ctl(me).ready, g + 1);
    for (int j = 0; j < cfg_.size; ++j) {
      if (j == me || !piece(j)) continue;
      wait_one(j, &Control::ready, g + 1, "allgather");
      std::memcpy(static_cast<char*>(out) + start[j] + off, window(j, half), piece(j));
    }
    shm::publish(ctl(me).consumed, g + 1);
    ++chunk_;
  }
}

void ShmTransport::oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                                 double postscale) {
  const size_t nbytes = n * dtype_size(dtype);
  if (nbytes > oob_capacity())
    throw std::invalid_argument("oob_allreduce takes at most " + std::to_string(oob_capacity()) +
                                " bytes; use allreduce for larger tensors");
  const uint32_t s = static_cast<uint32_t>(oob_seq_);
  const int me = cfg_.rank;
  // my single slot is free once every rank has finished the previous out-of-band reduction
  if (oob_seq_ >= 1) wait_all(&Control::oob_consumed, s, "oob_allreduce (slot reuse)");
  std::memcpy(oob(me), &rec, sizeof(Record));
  std::memcpy(oob(me) + sizeof(Record), in, nbytes);
  shm::publish(ctl(me).oob_ready, s + 1);
  wait_all(&Control::oob_ready, s + 1, "oob_allreduce");
  for (int j = 0; j < cfg_.size; ++j) {
    Record theirs;
    std::memcpy(&theirs, oob(j), sizeof(Record));
    std::string diff = compare_records(theirs, j, rec, me);
    if (!diff.empty()) {
      Record first;
      std::memcpy(&first, oob(0), sizeof(Record));
      // report the same pair on every rank: the first rank that differs from rank 0
      for (int k = 1; k < cfg_.size; ++k) {
        Record other;
        std::memcpy(&other, oob(k), sizeof(Record));
        std::string d = compare_records(first, 0, other, k);
        if (!d.empty()) throw Mismatch("oob_allreduce: " + d);
      }
      throw Mismatch("oob_allreduce: " + diff);
    }
  }
  // Every rank reduces all slots itself, in rank order: identical results, no second round trip.
  std::vector<const void*> srcs(cfg_.size);
  for (int j = 0; j < cfg_.size; ++j) srcs[j] = oob(j) + sizeof(Record);
  reduce_block(op, dtype, srcs.data(), cfg_.size, out, n, postscale);
  shm::publish(ctl(me).oob_consumed, s + 1);
  ++oob_seq_;
}

}  // namespace fastxfer
