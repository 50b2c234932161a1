// The shared-memory segment of one host's ranks. Layout:
//
//   [Header][rank 0: Control | records x2 | oob slot | window (2 halves)][rank 1: ...]...
//
// Every rank writes only its own area; it reads the others'. Progress is published through
// monotonically increasing counters in Control, one per phase, so "rank j has finished phase p of
// step g" is simply counter_p(j) >= g + 1. The collectives built on it are collectives/shm_*.cc;
// docs/algorithms.md lists their steps and bytes.
#include "transport/shm/segment.h"

#include "common/log.h"
#include "common/waiting.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

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
  // What this rank is blocked on, per lane (0: the engine thread, 1: the out-of-band lane), so
  // that a waiting peer can follow the chain of waits to the rank that stalls.
  struct Wait {
    std::atomic<int32_t> phase1;  // 1 + the Phase waited for; 0: not waiting
    std::atomic<int32_t> peer;    // the rank waited for
    std::atomic<uint32_t> target;
  } waits[2];
  std::atomic<int32_t> engine_idle;  // 1: the engine thread waits for work with nothing queued
  std::atomic<int32_t> mismatch;     // with state 3: the failure was a disagreement between ranks
};

namespace {
int lane_of(Phase p) { return p == Phase::kOobReady || p == Phase::kOobConsumed ? 1 : 0; }
const char* phase_what(int phase1) {
  switch (phase1 - 1) {
    case static_cast<int>(Phase::kRound): return "negotiation";
    case static_cast<int>(Phase::kReady):
    case static_cast<int>(Phase::kReduced):
    case static_cast<int>(Phase::kConsumed): return "a collective's data exchange";
    case static_cast<int>(Phase::kOobReady):
    case static_cast<int>(Phase::kOobConsumed): return "oob_allreduce";
    case static_cast<int>(Phase::kVerdict): return "the agreement round across hosts, which the host's first rank holds";
  }
  return "?";
}
}  // namespace

struct ShmSegment::WaitInfo {
  bool warned = false;
  double lanes_since = -1;     // when the cross-lane disagreement was first seen (-1: not seen)
  double stopped_since = -1;   // when the rank waited for was first seen stopped (SIGSTOP; -1: not seen)
  uint32_t lanes_snapshot[4];  // the counters it was seen with: nothing may move for it to count
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
char* ShmSegment::eager_slot(int j, int buf) const {
  return static_cast<char*>(base_) + header_bytes_ + j * stride_ + eager_off_ + static_cast<size_t>(buf) * kEagerSlotBytes;
}
uint32_t* ShmSegment::eager_count(int j, int buf) const {
  char* p = static_cast<char*>(base_) + header_bytes_ + j * stride_ + rec_off_;
  return reinterpret_cast<uint32_t*>(p) + 2 + buf;  // after the two record counts, in the same 64 bytes
}
char* ShmSegment::verdict(int buf) const {
  return static_cast<char*>(base_) + header_bytes_ + eager_off_ + 2 * kEagerSlotBytes + static_cast<size_t>(buf) * kVerdictBytes;
}
char* ShmSegment::oob_slot(int j) const { return static_cast<char*>(base_) + header_bytes_ + j * stride_ + oob_off_; }
char* ShmSegment::window(int j, int half) const {
  return static_cast<char*>(base_) + header_bytes_ + j * stride_ + win_off_ + half * (cfg_.window_bytes / 2);
}

size_t ShmSegment::rounded_window_bytes(size_t requested) {
  return round_up(std::max<size_t>(requested, 2 * kPage), 2 * kPage);
}

shm::Counter& ShmSegment::counter(int j, Phase phase) const { return ctl(j).phase[static_cast<int>(phase)]; }

std::string ShmSegment::path_of(const std::string& name) {
  if (name.find('/', 1) != std::string::npos) return name;  // a path: FASTXFER_SHM_DIR or /dev/shm
  return std::string("/dev/shm") + (name.empty() || name[0] != '/' ? "/" : "") + name;  // as shm_open
}

ShmSegment::Layout ShmSegment::layout_of(ShmConfig& cfg) {
  cfg.window_bytes = rounded_window_bytes(cfg.window_bytes);
  cfg.oob_bytes = round_up(std::max<size_t>(cfg.oob_bytes, kPage), kPage);
  if (cfg.max_records < 1) cfg.max_records = 1;
  Layout l;
  l.header_bytes = round_up(sizeof(Header), kPage);
  l.rec_off = round_up(sizeof(Control), kPage);
  l.eager_off = l.rec_off + round_up(64 + 2 * static_cast<size_t>(cfg.max_records) * sizeof(Record), kPage);
  // (every rank's stride has room for two verdicts; only rank 0's are used)
  l.oob_off = l.eager_off + 2 * kEagerSlotBytes + round_up(2 * kVerdictBytes, kPage);
  l.win_off = l.oob_off + cfg.oob_bytes;
  l.stride = l.win_off + cfg.window_bytes;
  l.total = l.header_bytes + l.stride * static_cast<size_t>(std::max(cfg.size, 0));
  return l;
}

size_t ShmSegment::bytes_for(ShmConfig cfg) { return layout_of(cfg).total; }

void ShmSegment::layout() {
  const Layout l = layout_of(cfg_);
  header_bytes_ = l.header_bytes;
  ctl_off_ = 0;
  rec_off_ = l.rec_off;
  eager_off_ = l.eager_off;
  oob_off_ = l.oob_off;
  win_off_ = l.win_off;
  stride_ = l.stride;
  total_ = l.total;
}

namespace {

std::string who(uid_t uid) {
  std::string s = "uid " + std::to_string(uid);
  char buf[1024];
  struct passwd pw, *found = nullptr;
  if (getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found) s += std::string(" (") + found->pw_name + ")";
  return s;
}

std::string mode_str(mode_t m) {
  char b[8];
  std::snprintf(b, sizeof(b), "%04o", static_cast<unsigned>(m & 07777));
  return b;
}

std::string describe_file(const struct stat& st) {
  std::string kind = S_ISREG(st.st_mode) ? "a file" : S_ISLNK(st.st_mode) ? "a symbolic link"
                                                    : S_ISDIR(st.st_mode) ? "a directory" : "a special file";
  return kind + " owned by " + who(st.st_uid) + " with mode " + mode_str(st.st_mode);
}

std::string mib_number(double bytes) {  // 16 MiB -> "16", 0.25 MiB -> "0.25", 69.523 MiB -> "69.52"
  char b[48];
  std::snprintf(b, sizeof(b), "%.2f", bytes / (1 << 20));
  std::string s = b;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}
std::string mib(double bytes) {
  if (bytes < (1 << 20)) return std::to_string(static_cast<long>(bytes / 1024)) + " KiB";
  return mib_number(bytes) + " MiB";
}

std::string dir_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

ShmSegment::ShmSegment(const ShmConfig& cfg) : cfg_(cfg), spin_s_(cfg.spin_us * 1e-6), path_(path_of(cfg.name)) {
  if (cfg_.size < 1 || cfg_.rank < 0 || cfg_.rank >= cfg_.size)
    throw std::invalid_argument("bad " + label(cfg_.rank) + " of " + std::to_string(cfg_.size));
  layout();

  const bool creator = cfg_.rank == 0;
  double deadline = now_s() + cfg_.attach_timeout_s;
  if (creator && !cfg_.precreated)
    create();
  else
    open_existing(deadline);
  base_ = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    int e = errno;
    if (creator) unlink(path_.c_str());
    close(fd_);
    throw EngineError("cannot map shared memory " + path_ + ": " + errno_str(e));
  }
  try {
    attach(creator, deadline);
  } catch (...) {
    // Leave nothing behind: the peers see the segment vanish (creator) or this rank never attach.
    if (creator) unlink(path_.c_str());
    munmap(base_, total_);
    base_ = nullptr;
    close(fd_);
    fd_ = -1;
    throw;
  }
}

ShmSegment::ShmSegment(const ShmConfig& cfg, Precreate)
    : cfg_(cfg), spin_s_(cfg.spin_us * 1e-6), path_(path_of(cfg.name)) {
  layout();
  create();  // on failure nothing is left behind
  close(fd_);
  fd_ = -1;
}

void ShmSegment::precreate(const ShmConfig& cfg) { ShmSegment made(cfg, Precreate{}); }

void ShmSegment::create() {
  // O_EXCL: never someone else's file under our name; O_NOFOLLOW: never through a planted link.
  fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0) {
    int e = errno;
    struct stat st;
    if (e == EEXIST && lstat(path_.c_str(), &st) == 0)
      throw EngineError("refusing to create shared-memory segment " + path_ + ": " + describe_file(st) +
                        " is already there. Segment names are fresh and unguessable at every init, so another "
                        "local user or program put it there; this job will not share memory with it (remove it "
                        "if it is yours, and check who can write to " + dir_of(path_) + ")");
    if (e == ENOENT)
      throw EngineError("cannot create shared-memory segment " + path_ + ": the directory " + dir_of(path_) +
                        " does not exist (FASTXFER_SHM_DIR names another one; default /dev/shm)");
    throw EngineError("cannot create shared-memory segment " + path_ + ": " + errno_str(e) +
                      (e == EACCES ? " (FASTXFER_SHM_DIR names another directory; default /dev/shm)" : ""));
  }
  try {
    reserve();
  } catch (...) {
    unlink(path_.c_str());
    close(fd_);
    fd_ = -1;
    throw;
  }
}

// Reserves every page of the segment now. On tmpfs, ftruncate alone only sets a size: the pages
// are allocated when first touched, and a /dev/shm too small for them (Docker's default is 64 MB)
// kills every rank with SIGBUS in the middle of an allreduce. fallocate allocates them all here,
// or fails with ENOSPC while there is still a rank to say why. KEEP_SIZE, then ftruncate: the file
// goes from 0 bytes to its full size in one step, so an attaching rank never sees a partial size.
void ShmSegment::reserve() {
  int rc;
  do {
    rc = fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(total_));
  } while (rc != 0 && errno == EINTR);
  int e = rc == 0 ? 0 : errno;
  if (e == EOPNOTSUPP || e == ENOSYS) {
    // a file system without fallocate (FASTXFER_SHM_DIR elsewhere): size it, then have
    // posix_fallocate write every block (attaching ranks wait for the header's magic anyway)
    if (ftruncate(fd_, static_cast<off_t>(total_)) != 0) {
      e = errno;
    } else {
      do {
        e = posix_fallocate(fd_, 0, static_cast<off_t>(total_));
      } while (e == EINTR);
    }
  } else if (e == 0 && ftruncate(fd_, static_cast<off_t>(total_)) != 0) {
    e = errno;
  }
  if (e == 0) return;
  const std::string dir = dir_of(path_);
  std::string msg = "cannot reserve the shared-memory segment for " + std::to_string(cfg_.size) + " ranks: it needs " +
                    mib(total_) + " (" + std::to_string(total_) + " bytes) in " + dir;
  struct statvfs vfs;
  const bool known = statvfs(dir.c_str(), &vfs) == 0;
  const double free_bytes = known ? static_cast<double>(vfs.f_bavail) * vfs.f_frsize : 0;
  if (known) msg += ", and only " + mib(free_bytes) + " is free there";
  msg += " (" + errno_str(e) + ").";
  if (e == ENOSPC || e == ENOMEM || e == EDQUOT || e == EFBIG) {
    const double need_mib = std::ceil(static_cast<double>(total_) / (1 << 20));
    msg += " Give " + dir + " more room (Docker: docker run --shm-size=" + std::to_string(static_cast<long>(need_mib)) +
           "m or more; Kubernetes: an emptyDir volume with medium: Memory mounted there), point FASTXFER_SHM_DIR at a "
           "directory with room (a larger tmpfs), or shrink each rank's staging window with FASTXFER_SHM_WINDOW_MB (now " +
           mib_number(cfg_.window_bytes) + "; the segment is " +
           mib(header_bytes_) + " + " + std::to_string(cfg_.size) + " x (" + mib(stride_ - cfg_.window_bytes) +
           " + the window))";
    if (known) {
      // the largest window, in quarter MiB, that fits in what is free now
      const double per_rank = (free_bytes - header_bytes_) / cfg_.size - static_cast<double>(stride_ - cfg_.window_bytes);
      const double q = std::floor(per_rank / (1 << 18)) / 4;
      if (q >= 0.25) {
        char b[32];
        std::snprintf(b, sizeof(b), "%g", q);
        msg += std::string("; FASTXFER_SHM_WINDOW_MB=") + b + " or less fits in what is free now";
      } else {
        msg += "; not even the smallest window fits in what is free now";
      }
    }
    msg += ".";
  }
  throw EngineError(msg);
}

void ShmSegment::open_existing(double deadline) {
  const uid_t me = geteuid();
  for (;;) {
    fd_ = open(path_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd_ >= 0) {
      struct stat st;
      if (fstat(fd_, &st) != 0) {
        int e = errno;
        close(fd_);
        fd_ = -1;
        throw EngineError("cannot inspect shared-memory segment " + path_ + ": " + errno_str(e));
      }
      // Only a segment this user made for this job, and nobody else can write: checked on the open
      // file, before mapping, so it cannot be swapped between the check and the mmap.
      if (!S_ISREG(st.st_mode) || st.st_uid != me || (st.st_mode & 077) != 0) {
        close(fd_);
        fd_ = -1;
        throw EngineError("refusing to use shared-memory segment " + path_ + ": it is " + describe_file(st) +
                          ", but this job's segments are files owned by " + who(me) +
                          " with mode 0600. Another local user or program created it under this job's name; "
                          "this rank will not share memory with it");
      }
      if (static_cast<size_t>(st.st_size) == total_) return;
      close(fd_);
      fd_ = -1;
      if (st.st_size != 0)
        throw Mismatch("ranks disagree on the job layout: the shared-memory segment has " +
                       std::to_string(st.st_size) + " bytes, this rank expects " + std::to_string(total_) +
                       " (same size, window and oob settings on every rank?)");
    } else if (errno == EACCES || errno == EPERM || errno == ELOOP) {
      int e = errno;
      struct stat st;
      if (lstat(path_.c_str(), &st) == 0)
        throw EngineError("refusing to use shared-memory segment " + path_ + ": it is " + describe_file(st) +
                          ", but this job's segments are files owned by " + who(me) +
                          " with mode 0600. Another local user or program created it under this job's name");
      throw EngineError("cannot open shared-memory segment " + path_ + ": " + errno_str(e));
    } else if (errno != ENOENT) {
      throw EngineError("cannot open shared-memory segment " + path_ + ": " + errno_str(errno));
    } else if (cfg_.precreated && cfg_.rank == 0) {
      throw EngineError("the shared-memory segment " + path_ + " this rank created a moment ago is gone: "
                        "something removed it from " + dir_of(path_));
    }
    check_members_alive(false);
    if (now_s() > deadline)
      throw PeerFailure(label(cfg_.rank) + " did not find the job's shared memory (" + path_ +
                        ") within " + std::to_string(static_cast<int>(cfg_.attach_timeout_s)) +
                        " s: rank 0 never started or failed first (see its error), the ranks called "
                        "fastxfer.init() different numbers of times, or they are not on one host (several "
                        "hosts need MPI: pip install 'fastxfer[mpi]' and launch with fastxfer run --hosts or "
                        "mpirun)");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void ShmSegment::check_members_alive(bool mapped) const {
  // Members that have not attached yet (every member while the segment is not mapped): a dead one
  // is reported now, by the pid the launcher gave. Any member, not only the creator: when one dies,
  // the creator gives up on this generation and the others must not wait for its file.
  const int n = std::min<int>(cfg_.size, static_cast<int>(cfg_.member_pids.size()));
  for (int j = 0; j < n; ++j) {
    const int pid = cfg_.member_pids[j];
    if (pid <= 0 || j == cfg_.rank) continue;
    if (mapped && ctl(j).state.load() >= 1) continue;  // attached: its own pid is watched
    if (kill(pid, 0) != 0 && errno == ESRCH)
      throw PeerFailure(label(j) + " (pid " + std::to_string(pid) + ") died before it attached to the job's shared "
                        "memory; the job re-forms without it");
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
                     " window=" + std::to_string(h->window_bytes) + ", " + label(cfg_.rank) +
                     " has size=" + std::to_string(cfg_.size) + " window=" + std::to_string(cfg_.window_bytes));
  }
  Control& me = ctl(cfg_.rank);
  me.pid = shm::self_process_id();
  me.state.store(1, std::memory_order_release);
  shm::increment(h->attached);  // every rank adds to it: a store could lose another rank's count
  while (!shm::reached(h->attached.value.load(std::memory_order_acquire), static_cast<uint32_t>(cfg_.size))) {
    for (int j = 0; j < cfg_.size; ++j) {
      Control& c = ctl(j);
      if (c.state.load() >= 1 && !shm::process_alive(c.pid))
        throw PeerFailure(label(j) + " died while the job was starting");
    }
    check_members_alive(true);
    if (now_s() > deadline)
      throw PeerFailure("only " + std::to_string(h->attached.value.load()) + " of " + std::to_string(cfg_.size) +
                        " ranks attached within " + std::to_string(static_cast<int>(cfg_.attach_timeout_s)) +
                        " s (are all ranks on one host? several hosts need MPI)");
    uint32_t seen = h->attached.value.load();
    shm::sleep_on(h->attached, seen, 50);
  }
  // Everyone has it mapped: drop the name so no crash can leave the segment behind.
  if (creator) unlink(path_.c_str());
}

void ShmSegment::publish(Phase phase, uint32_t value) { shm::publish(counter(cfg_.rank, phase), value); }

ShmSegment::~ShmSegment() {
  if (base_) munmap(base_, total_);
  if (fd_ >= 0) close(fd_);
}

int ShmSegment::job_rank(int j) const {
  return j >= 0 && j < static_cast<int>(cfg_.rank_names.size()) ? cfg_.rank_names[j] : j;
}

std::string ShmSegment::label(int j) const { return "rank " + std::to_string(job_rank(j)); }

void ShmSegment::set_engine_idle(bool idle) { ctl(cfg_.rank).engine_idle.store(idle ? 1 : 0, std::memory_order_release); }

void ShmSegment::mark_exited(bool clean, const char* why, bool mismatch) {
  Control& me = ctl(cfg_.rank);
  if (why) {
    std::strncpy(me.why, why, sizeof(me.why) - 1);
    me.why[sizeof(me.why) - 1] = 0;
  }
  me.mismatch.store(mismatch ? 1 : 0, std::memory_order_relaxed);
  me.state.store(clean ? 2 : 3, std::memory_order_release);
  // wake anyone sleeping on my counters so they notice now, not at their next tick
  for (shm::Counter& c : me.phase)
    shm::wake(c);  // only wake: storing here could move a counter back under the engine thread
}

int ShmSegment::stalled_rank(int j, std::string* doing) const {
  // Follow "j waits for k" (on either lane) until a rank that waits for nobody, or a cycle.
  std::vector<bool> seen(cfg_.size, false);
  seen[cfg_.rank] = true;
  for (;;) {
    seen[j] = true;
    const Control& c = ctl(j);
    int next = -1;
    for (const auto& w : c.waits) {
      if (w.phase1.load(std::memory_order_acquire) == 0) continue;
      int k = w.peer.load(std::memory_order_relaxed);
      if (k >= 0 && k < cfg_.size && !seen[k]) next = k;
    }
    if (next < 0) break;
    j = next;
  }
  const Control& c = ctl(j);
  const char st = shm::process_state(c.pid);
  std::string what;
  if (st == 'T' || st == 't') {
    what = "is stopped (SIGSTOP or a debugger)";
  } else if (c.waits[0].phase1.load() || c.waits[1].phase1.load()) {
    const int l = c.waits[0].phase1.load() ? 0 : 1;
    what = "is itself waiting (" + std::string(phase_what(c.waits[l].phase1.load())) + ") for " +
           label(c.waits[l].peer.load()) + ": the ranks wait for each other";
  } else {
    what = "is alive but has not reached the next collective (still computing, or hung outside fastxfer)";
  }
  what += " [pid " + std::to_string(c.pid.pid) + "]";
  if (doing) *doing = what;
  return j;
}

void ShmSegment::report_stall(int culprit, const std::string& msg) const { report(job_rank(culprit), "stalled", msg); }

void ShmSegment::report(int job_culprit, const std::string& kind, const std::string& msg) const {
  // For `fastxfer run`: the rank that gives up is not the culprit; the report says which one is.
  // A rank's first culprit stands: a later failure of the same rank (its exit-time shutdown
  // waiting for a peer that computes, say) must not blame another rank over it.
  if (cfg_.report_dir.empty()) return;
  const std::string path = cfg_.report_dir + "/stall." + std::to_string(job_rank(cfg_.rank));
  {
    const int old = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (old >= 0) {
      char head[32] = {};
      const ssize_t n = read(old, head, sizeof head - 1);
      close(old);
      if (n > 0 && std::atoi(head) != job_culprit) return;
    }
  }
  const std::string tmp = path + ".tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return;
  const std::string text = std::to_string(job_culprit) + " " + kind + "\n" + msg + "\n";
  bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  if (ok) rename(tmp.c_str(), path.c_str());
  else unlink(tmp.c_str());
}

void ShmSegment::check_lanes(Phase phase, int j, WaitInfo& info) {
  // oob_allreduce called on some ranks only: one rank waits in oob_allreduce for a peer whose
  // engine waits in negotiation for it, while neither lane of either rank can move. Each rank
  // sees the same picture from its side; it must hold, with no counter moving, for a second
  // (a rank's engine may be a moment late to publish a round it has queued).
  const int me = cfg_.rank;
  int oob_rank, eng_rank;
  if (phase == Phase::kOobReady) {
    oob_rank = me, eng_rank = j;
  } else if (phase == Phase::kRound) {
    oob_rank = j, eng_rank = me;
  } else {
    info.lanes_since = -1;
    return;
  }
  const Control& o = ctl(oob_rank);
  const Control& e = ctl(eng_rank);
  auto val = [&](const Control& c, Phase p) { return c.phase[static_cast<int>(p)].value.load(std::memory_order_acquire); };
  const uint32_t snap[4] = {val(o, Phase::kRound), val(e, Phase::kRound), val(o, Phase::kOobReady),
                            val(e, Phase::kOobReady)};
  const bool stuck = o.engine_idle.load() == 1 && o.waits[0].phase1.load() == 0 &&
                     o.waits[1].phase1.load() == static_cast<int>(Phase::kOobReady) + 1 &&
                     e.waits[0].phase1.load() == static_cast<int>(Phase::kRound) + 1 && e.waits[1].phase1.load() == 0 &&
                     !shm::reached(snap[0], snap[1]) && !shm::reached(snap[3], snap[2]);
  if (!stuck) {
    info.lanes_since = -1;
    return;
  }
  if (info.lanes_since < 0 || std::memcmp(snap, info.lanes_snapshot, sizeof snap) != 0) {
    info.lanes_since = now_s();
    std::memcpy(info.lanes_snapshot, snap, sizeof snap);
    return;
  }
  if (now_s() - info.lanes_since < 1.0) return;
  Record oob_rec;
  std::memcpy(&oob_rec, oob_slot(oob_rank), sizeof(Record));
  const int buf = static_cast<int>((snap[1] - 1) & 1);
  const uint32_t n = std::min<uint32_t>(*record_count(eng_rank, buf), static_cast<uint32_t>(cfg_.max_records));
  std::string theirs = n ? describe(records(eng_rank, buf)[0]) : std::string("a collective");
  oob_rec.name[sizeof(oob_rec.name) - 1] = 0;
  throw Mismatch(label(oob_rank) + " called oob_allreduce '" + std::string(oob_rec.name) +
                 "' but " + label(eng_rank) + " did not: it issued " + theirs +
                 " and waits for " + label(oob_rank) +
                 ". Every rank must call oob_allreduce at the same point of its sequence of collectives");
}

void ShmSegment::check_local_peers(const char* what) const {
  for (int j = 0; j < cfg_.size; ++j) {
    if (j == cfg_.rank) continue;
    const Control& c = ctl(j);
    const int32_t st = c.state.load(std::memory_order_acquire);
    // A disagreement between ranks is not a failure to give up on: every rank's own exchange
    // completes (the rank that saw it first sent its part) and raises the same, full message.
    if (st == 3 && !c.mismatch.load(std::memory_order_relaxed))
      throw PeerFailure(label(j) + " failed: " + std::string(c.why, strnlen(c.why, sizeof(c.why))));
    if (st == 1 && !shm::process_alive(c.pid))
      throw PeerFailure(label(j) + " (pid " + std::to_string(c.pid.pid) + ") died during " + what);
  }
}

void ShmSegment::check_peers(int waiting_for, Phase phase, const char* what, double waited_s, WaitInfo& info) {
  if (aborted_.load()) throw EngineError("the engine was shut down while waiting (" + std::string(what) + ")");
  for (int j = 0; j < cfg_.size; ++j) {
    if (j == cfg_.rank) continue;
    Control& c = ctl(j);
    int32_t st = c.state.load(std::memory_order_acquire);
    if (st == 3) {
      std::string why(c.why, strnlen(c.why, sizeof(c.why)));
      if (c.mismatch.load(std::memory_order_relaxed)) throw Mismatch(why);
      throw PeerFailure(label(j) + " failed: " + why);
    }
    if (st == 2 && j == waiting_for)
      throw PeerFailure(label(j) + " has shut down while " + label(cfg_.rank) +
                        " still waits for it (" + what + "): the ranks did not issue the same collectives");
    if (st != 2 && !shm::process_alive(c.pid))
      throw PeerFailure(label(j) + " (pid " + std::to_string(c.pid.pid) + ") died during " + what);
  }
  if (waited_s > 0.5) check_lanes(phase, waiting_for, info);
  // A stopped process (SIGSTOP, SIGTSTP, a debugger) cannot answer: after kStoppedS stopped it is a
  // failure, not a stall that waits out FASTXFER_TIMEOUT (an elastic job re-forms without it).
  constexpr double kStoppedS = 5;
  if (waited_s > 1) {
    const Control& w = ctl(waiting_for);
    const char st = shm::process_state(w.pid);
    if (st == 'T' || st == 't') {
      if (info.stopped_since < 0) info.stopped_since = waited_s;
      if (waited_s - info.stopped_since >= std::min(kStoppedS, cfg_.timeout_s)) {
        const std::string msg = label(waiting_for) + " (pid " + std::to_string(w.pid.pid) + ") is stopped (SIGSTOP, " +
                                "SIGTSTP or a debugger) while " + label(cfg_.rank) + " waits for it (" + what +
                                "): declared failed after " + std::to_string(static_cast<int>(kStoppedS)) +
                                " s stopped";
        report_stall(waiting_for, msg);
        throw PeerFailure(msg);
      }
    } else {
      info.stopped_since = -1;
    }
  }
  const bool warn = !info.warned && waited_s > cfg_.stall_warning_s && cfg_.stall_warning_s < cfg_.timeout_s;
  if (warn || waited_s > cfg_.timeout_s) {
    std::string doing;
    const int culprit = stalled_rank(waiting_for, &doing);
    const std::string who = label(culprit);
    if (warn) {
      info.warned = true;
      const std::string msg = label(cfg_.rank) + " has waited " +
                              std::to_string(static_cast<int>(waited_s)) + " s for " +
                              label(waiting_for) + " (" + what + "); " + who + " " + doing +
                              ". It is declared failed after FASTXFER_TIMEOUT=" +
                              std::to_string(static_cast<int>(cfg_.timeout_s)) + " s";
      log_line(kLogWarning, "stall: " + msg);
      report_stall(culprit, msg);
      return;
    }
    const Control& me = ctl(cfg_.rank);
    const Control& them = ctl(waiting_for);
    auto counters = [](const Control& c) {
      auto v = [&](Phase p) { return std::to_string(c.phase[static_cast<int>(p)].value.load()); };
      return "ready=" + v(Phase::kReady) + " reduced=" + v(Phase::kReduced) + " consumed=" + v(Phase::kConsumed) +
             " round=" + v(Phase::kRound);
    };
    const std::string msg = who + " stalled: " + label(cfg_.rank) + " waited " +
                            std::to_string(static_cast<int>(cfg_.timeout_s)) + " s for " +
                            label(waiting_for) + " (" + what + ") and " + who + " " + doing +
                            "; raise FASTXFER_TIMEOUT if ranks legitimately drift apart this far [" +
                            label(cfg_.rank) + ": " + counters(me) + "; " +
                            label(waiting_for) + ": " + counters(them) + "]";
    report_stall(culprit, msg);
    throw PeerFailure(msg);
  }
}

void ShmSegment::wait_one(int j, Phase phase, uint32_t target, const char* what) {
  shm::Counter& c = counter(j, phase);
  if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
  // Spin a little (a peer a few microseconds behind costs no system call), then sleep on the
  // futex: a rank that waits long for a slower peer must not take a core from the computation.
  // How long: spin_s_ on a thread waiting for its own result, see the end; else FASTXFER_SPIN_US.
  double start = now_s();
  const bool own = OwnResultWait::active();
  const double spin = own ? spin_s_.load(std::memory_order_relaxed) : cfg_.spin_us * 1e-6;
  if (spin > 0) {
    const double until = start + spin;
    for (int pauses = 1;; ++pauses) {
      if (shm::reached(c.value.load(std::memory_order_acquire), target)) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      if ((pauses & 63) == 0 && now_s() > until) break;
    }
  }
  // Say what I am blocked on, for the peers' stall and mismatch checks (cleared on the way out).
  Control::Wait& w = ctl(cfg_.rank).waits[lane_of(phase)];
  w.peer.store(j, std::memory_order_relaxed);
  w.target.store(target, std::memory_order_relaxed);
  w.phase1.store(static_cast<int>(phase) + 1, std::memory_order_release);
  struct Clear {
    Control::Wait& w;
    ~Clear() { w.phase1.store(0, std::memory_order_release); }
  } clear{w};
  WaitInfo info;
  for (;;) {
    uint32_t v = c.value.load(std::memory_order_acquire);
    if (shm::reached(v, target)) break;
    shm::sleep_on(c, v, 100);
    if (shm::reached(c.value.load(std::memory_order_acquire), target)) break;
    check_peers(j, phase, what, now_s() - start, info);
  }
  // This wait slept. Over soon after (within twice the most it may spin), a longer spin would have
  // saved the sleep and its wake-up: on a VM whose idle vCPUs halt, a futex wake-up takes 100-400
  // us, and two ranks that each sleep through the other's wake-up stay in that mode for whole
  // runs (every step costs a wake-up). So a thread waiting for its own result spins longer next
  // time: twice as long, or 1.25 times this wait, up to spin_max_us. A long wait is a peer
  // computing: back to the short spin. The engine thread keeps the short spin: its waits overlap
  // the computation, whose core a longer spin would take (common/waiting.h).
  const double base = cfg_.spin_us * 1e-6, most = cfg_.spin_max_us * 1e-6;
  if (!own || base <= 0 || most <= base) return;
  const double waited = now_s() - start;
  spin_s_.store(waited <= 2 * most ? std::min(most, std::max(2 * spin, 1.25 * waited)) : base,
                std::memory_order_relaxed);
}

void ShmSegment::wait_all(Phase phase, uint32_t target, const char* what) {
  for (int j = 0; j < cfg_.size; ++j) wait_one(j, phase, target, what);
}

}  // namespace fastxfer
