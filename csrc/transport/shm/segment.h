// One POSIX shared-memory segment shared by the ranks of a host: its layout, start-up, the
// per-rank progress counters peers wait on, and the liveness checks that turn a dead or silent
// peer into an error. It moves no data itself: collectives write into the areas it hands out and
// publish their progress through its counters (collectives/shm_*.cc).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/request.h"
#include "transport/shm/sync.h"

namespace fastxfer {

struct ShmConfig {
  // Where the segment lives: a path ("/dev/shm/fastxfer-<pid>-<tag>", or under FASTXFER_SHM_DIR),
  // or a bare POSIX shm name ("/fastxfer-...", meaning /dev/shm/fastxfer-...). Fresh and
  // unguessable at every init (fastxfer/comm/segments.py derives it; docs/architecture.md).
  std::string name;
  int rank = 0;                // rank among the processes sharing this segment
  int size = 1;
  size_t window_bytes = 16u << 20;  // per-rank staging window (two halves, double-buffered)
  size_t oob_bytes = 1u << 20;      // per-rank out-of-band slot
  int max_records = 1024;           // request descriptors one negotiation round can carry
  double timeout_s = 300;           // a peer that does not answer for this long is a failure
  double attach_timeout_s = 120;    // how long ranks wait for each other at start-up
  double spin_us = 50;              // how long a wait spins before it sleeps (FASTXFER_SPIN_US)
  double spin_max_us = 1000;        // the most it spins once short sleeps showed spinning pays
                                    // (FASTXFER_SPIN_MAX_US; <= spin_us: a fixed spin)
  double stall_warning_s = 60;      // a wait this long warns once, naming the rank that stalls
  std::string report_dir;           // where the launcher collects stall reports (FASTXFER_REPORT_DIR)
  std::vector<int> rank_names;      // the job rank of each rank of the segment, for messages (empty:
                                    // the same numbers; a process set's or another host's differ)
  std::vector<int> member_pids;     // each rank's process id when the launcher told it (elastic jobs;
                                    // 0 or empty: unknown): a rank that dies before it attaches is
                                    // noticed at once instead of after attach_timeout_s
  bool precreated = false;          // rank 0 opens the file ShmSegment::precreate made (process sets:
                                    // every member learns whether that worked before attaching)
};

// The counters each rank publishes, one per protocol phase. What a phase means is the business of
// the collective that uses it; the segment only stores, publishes and waits.
// Bytes of packed data a rank can send with its records in one negotiation round (per record
// buffer): the largest bucket the one-exchange path takes (docs/algorithms.md, "Small allreduces").
constexpr size_t kEagerSlotBytes = 64u << 10;
// Bytes of what the host's first rank tells the others after a negotiation round across hosts
// (collectives/hierarchical.cc, "one rank per host"): a 64-byte verdict, then at most one
// eager bucket's sum over hosts.
constexpr size_t kVerdictBytes = 64 + kEagerSlotBytes;

enum class Phase : int { kReady = 0, kReduced, kConsumed, kRound, kOobReady, kOobConsumed, kVerdict };
constexpr int kPhases = 7;
static_assert(static_cast<int>(Phase::kVerdict) + 1 == kPhases, "one counter per phase");

class ShmSegment {
 public:
  // Rank 0 creates the segment (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600) and reserves all its
  // pages up front, so a full /dev/shm is a clear error here and never a SIGBUS later; the others
  // open it and refuse it unless it is a regular file owned by their own euid with no group or
  // other permission bits. Once all have attached, rank 0 unlinks the name, so nothing is left in
  // /dev/shm even if every rank is killed later.
  explicit ShmSegment(const ShmConfig& cfg);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Rank 0's first step on its own: create the file exclusively and reserve its pages, then close it,
  // leaving it for the constructor (cfg.precreated on rank 0; the others as usual). A full /dev/shm
  // or a name already taken throws here, before any peer starts waiting for the file.
  static void precreate(const ShmConfig& cfg);
  // The window size the segment really uses for a requested one (whole pages per half).
  static size_t rounded_window_bytes(size_t requested);
  // The bytes a segment of `cfg` takes in /dev/shm (cfg.size ranks), as the constructor lays it out.
  static size_t bytes_for(ShmConfig cfg);
  // The file a ShmConfig::name refers to ("/fastxfer-x" -> "/dev/shm/fastxfer-x"; a path stays).
  static std::string path_of(const std::string& name);

  int rank() const { return cfg_.rank; }
  int size() const { return cfg_.size; }
  const ShmConfig& config() const { return cfg_; }

  // Rank j's areas. Every rank writes only its own; it reads the others'.
  char* window(int j, int half) const;       // half of rank j's staging window (0 or 1)
  size_t window_half_bytes() const { return cfg_.window_bytes / 2; }
  char* oob_slot(int j) const;               // rank j's out-of-band slot (oob_bytes)
  Record* records(int j, int buf) const;     // rank j's record buffer `buf` (0 or 1), max_records long
  uint32_t* record_count(int j, int buf) const;
  // Rank j's small-allreduce data sent with record buffer `buf` (kEagerSlotBytes), and how many of
  // that buffer's leading records it covers (collectives/shm_eager.cc).
  char* eager_slot(int j, int buf) const;
  uint32_t* eager_count(int j, int buf) const;
  // Rank 0's verdict of the round whose record buffer is `buf`, for the host's other ranks
  // (kVerdictBytes; published with Phase::kVerdict). Only rank 0 writes it.
  char* verdict(int buf) const;

  // Stores my counter for `phase` and wakes whoever sleeps on it.
  void publish(Phase phase, uint32_t value);
  // Blocks until rank j's counter for `phase` reaches `target` (serial arithmetic), failing fast
  // with PeerFailure when a peer died, failed or fell silent; `what` names the step for errors.
  void wait_one(int j, Phase phase, uint32_t target, const char* what);
  // How long a wait on a thread waiting for its own result spins now, in seconds (see spin_s_).
  double spin_s() const { return spin_s_.load(std::memory_order_relaxed); }
  void wait_all(Phase phase, uint32_t target, const char* what);

  // Tells the peers this rank is leaving: cleanly (after a shutdown) or with an error message,
  // so they fail fast instead of waiting for a timeout. `mismatch`: the error was a disagreement
  // between ranks, which the peers then raise as a Mismatch too (with this rank's message).
  void mark_exited(bool clean, const char* why, bool mismatch = false);
  // For `fastxfer run` (its report folder): this rank failed because of rank `job_culprit` (a rank
  // of the job), which `kind` ("stalled", "finished", "failed"): REPORT_DIR/stall.<this rank>. The first
  // culprit a rank names stands (a later report naming another rank is dropped).
  void report(int job_culprit, const std::string& kind, const std::string& msg) const;
  // Whether nothing is queued on this rank and no thread runs a round (what the out-of-band lane's
  // mismatch check needs to know: docs/algorithms.md, "oob_allreduce").
  void set_engine_idle(bool idle);
  // "rank N" for the segment's rank j, N its rank in the job (what users see in messages).
  std::string label(int j) const;
  int job_rank(int j) const;
  // Throws PeerFailure if another rank of the segment failed (its message) or died, but not when it
  // failed on a disagreement between ranks (which every rank finds itself); returns at once.
  void check_local_peers(const char* what) const;
  // Makes every wait in progress (and later) throw EngineError.
  void abort() { aborted_.store(true); }

 private:
  struct Precreate {};
  ShmSegment(const ShmConfig& cfg, Precreate);
  struct Header;
  struct Control;

  struct Layout {
    size_t header_bytes = 0, rec_off = 0, eager_off = 0, oob_off = 0, win_off = 0, stride = 0, total = 0;
  };
  static Layout layout_of(ShmConfig& cfg);      // normalises cfg's sizes, then the offsets
  void layout();                                // offsets and total_ from cfg_
  void create();                                // rank 0: exclusive create + reserve every page
  void open_existing(double deadline);          // the others: wait for it, check owner and mode
  void reserve();                               // fallocate the whole segment, or a clear error
  void attach(bool creator, double deadline);   // the constructor's part after mmap
  Control& ctl(int j) const;
  shm::Counter& counter(int j, Phase phase) const;
  struct WaitInfo;
  void check_peers(int waiting_for, Phase phase, const char* what, double waited_s, WaitInfo& info);
  // The rank at the end of the chain "j waits for k waits for ...", and a sentence on what it does.
  int stalled_rank(int j, std::string* doing) const;
  void check_lanes(Phase phase, int j, WaitInfo& info);
  void report_stall(int culprit, const std::string& msg) const;
  void check_members_alive(bool mapped) const;

  ShmConfig cfg_;
  // How long a wait spins now: cfg_.spin_us, grown toward cfg_.spin_max_us by waits that slept and
  // were over soon after, back to cfg_.spin_us after a long one (wait_one; docs/architecture.md,
  // "Waiting for a peer"). Shared by this rank's threads: a race only costs one wait's choice.
  std::atomic<double> spin_s_{0};
  std::string path_;  // the segment's file (path_of(cfg_.name))
  int fd_ = -1;
  void* base_ = nullptr;
  size_t total_ = 0;
  size_t stride_ = 0, ctl_off_ = 0, rec_off_ = 0, eager_off_ = 0, oob_off_ = 0, win_off_ = 0, header_bytes_ = 0;
  std::atomic<bool> aborted_{false};
};

}  // namespace fastxfer
