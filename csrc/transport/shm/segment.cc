// The shared-memory segment of one host's ranks. Layout:
//
//   [Header][rank 0: Control | records x2 | oob slot | window (2 halves)][rank 1: ...]...
//
// Every rank writes only its own area; it reads the others'. Progress is published through
// monotonically increasing counters in Control, one per phase, so "rank j has finished phase p of
// step g" is simply counter_p(j) >= g + 1. The collectives built on it are collectives/shm_*.cc;
// docs/algorithms.md lists their steps and bytes.
#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/errors.h"

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

struct ShmSegment::Header {
  std::atomic<uint64_t> magic;  // written last by the creator
  int32_t size;
  int32_t max_records;
  uint64_t window_bytes;
  uint64_t oob_bytes;
  shm::Counter attached;
};

struct ShmSegment::Control {
  shm::Counter phase[kPhases];  // indexed by Phase
  alignas(64) shm::ProcessId pid;
  std::atomic<int32_t> state;  // 0 attaching, 1 running, 2 left cleanly, 3 failed
  char why[240];
};

ShmSegment::Control& ShmSegment::ctl(int j) const {
  return *reinterpret_cast<Control*>(static_cast<char*>(base_) + header_bytes_ + j * stride_ + ctl_off_);
}
Record* ShmSegment::records(int j, int buf) const {
  char* p = static_cast<char*>(base_) + header_bytes_ + j * stride_ + rec_off_;
  return reinterpret_cast<Record*>(p + 64 + static_cast<size_t>(buf) * cfg_.max_records * sizeof(Record));
}
uint32_t* ShmSegment::record_count(int j, int buf) const {
  char* p = static_cast<char*>(base_) + header_bytes_ + j * stride_ + rec_off_;
  return reinterpret_cast<uint32_t*>(p) + buf;
}
char* ShmSegment::oob_slot(int j) const { return static_cast<char*>(base_) + header_bytes_ + j * stride_ + oob_off_; }
char* ShmSegment::window(int j, int half) const {
  return static_cast<char*>(base_) + header_bytes_ + j * stride_ + win_off_ + half * (cfg_.window_bytes / 2);
}

size_t ShmSegment::rounded_window_bytes(size_t requested) {
  return round_up(std::max<size_t>(requested, 2 * kPage), 2 * kPage);
}

shm::Counter& ShmSegment::counter(int j, Phase phase) const { return ctl(j).phase[static_cast<int>(phase)]; }

ShmSegment::ShmSegment(const ShmConfig& cfg) : cfg_(cfg) {
  if (cfg_.size < 1 || cfg_.rank < 0 || cfg_.rank >= cfg_.size)
    throw std::invalid_argument("bad rank " + std::to_string(cfg_.rank) + " of " + std::to_string(cfg_.size));
  cfg_.window_bytes = rounded_window_bytes(cfg_.window_bytes);
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

void ShmSegment::attach(bool creator, double deadline) {
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

void ShmSegment::publish(Phase phase, uint32_t value) { shm::publish(counter(cfg_.rank, phase), value); }

ShmSegment::~ShmSegment() {
  if (base_) munmap(base_, total_);
  if (fd_ >= 0) close(fd_);
}

void ShmSegment::mark_exited(bool clean, const char* why) {
  Control& me = ctl(cfg_.rank);
  if (why) {
    std::strncpy(me.why, why, sizeof(me.why) - 1);
    me.why[sizeof(me.why) - 1] = 0;
  }
  me.state.store(clean ? 2 : 3, std::memory_order_release);
  // wake anyone sleeping on my counters so they notice now, not at their next tick
  for (shm::Counter& c : me.phase)
    shm::wake(c);  // only wake: storing here could move a counter back under the engine thread
}

void ShmSegment::check_peers(int waiting_for, const char* what, double waited_s) {
  if (aborted_.load()) throw EngineError("the engine was shut down while waiting (" + std::string(what) + ")");
  for (int j = 0; j < cfg_.size; ++j) {
    if (j == cfg_.rank) continue;
    Control& c = ctl(j);
    int32_t st = c.state.load(std::memory_order_acquire);
    if (st == 3)
      throw PeerFailure("rank " + std::to_string(j) + " failed: " + std::string(c.why, strnlen(c.why, sizeof(c.why))));
    if (st == 2 && j == waiting_for)
      throw PeerFailure("rank " + std::to_string(j) + " has shut down while rank " + std::to_string(cfg_.rank) +
                        " still waits for it (" + what + "): the ranks did not issue the same collectives");
    if (st != 2 && !shm::process_alive(c.pid))
      throw PeerFailure("rank " + std::to_string(j) + " (pid " + std::to_string(c.pid.pid) + ") died during " + what);
  }
  if (waited_s > cfg_.timeout_s) {
    const Control& me = ctl(cfg_.rank);
    const Control& them = ctl(waiting_for);
    auto counters = [](const Control& c) {
      auto v = [&](Phase p) { return std::to_string(c.phase[static_cast<int>(p)].value.load()); };
      return "ready=" + v(Phase::kReady) + " reduced=" + v(Phase::kReduced) + " consumed=" + v(Phase::kConsumed) +
             " round=" + v(Phase::kRound);
    };
    throw PeerFailure("rank " + std::to_string(waiting_for) + " did not answer within " +
                      std::to_string(static_cast<int>(cfg_.timeout_s)) + " s (" + what +
                      "); raise FASTXFER_TIMEOUT if ranks legitimately drift apart this far [rank " +
                      std::to_string(cfg_.rank) + ": " + counters(me) + "; rank " + std::to_string(waiting_for) +
                      ": " + counters(them) + "]");
  }
}

void ShmSegment::wait_one(int j, Phase phase, uint32_t target, const char* what) {
  shm::Counter& c = counter(j, phase);
  if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
  // Spin a little (a peer a few microseconds behind costs no system call), then sleep on the
  // futex: a rank that waits long for a slower peer must not take a core from the computation.
  double start = now_s();
  if (cfg_.spin_us > 0) {
    const double until = start + cfg_.spin_us * 1e-6;
    for (int spin = 1;; ++spin) {
      if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      if ((spin & 63) == 0 && now_s() > until) break;
    }
  }
  for (;;) {
    uint32_t v = c.value.load(std::memory_order_acquire);
    if (shm::reached(v, target)) return;
    shm::sleep_on(c, v, 100);
    if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
    check_peers(j, what, now_s() - start);
  }
}

void ShmSegment::wait_all(Phase phase, uint32_t target, const char* what) {
  for (int j = 0; j < cfg_.size; ++j) wait_one(j, phase, target, what);
}

}  // namespace fastxfer
