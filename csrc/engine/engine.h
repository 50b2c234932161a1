// The engine: a background thread that takes collective requests in program order, agrees with
// the other ranks on how many of them to run next, fuses consecutive allreduces into buckets and
// drives the collectives. Python threads only enqueue and wait; this thread never touches Python.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "collectives/collectives.h"
#include "engine/c_api.h"
#include "engine/eager_tuner.h"
#include "engine/timeline.h"
#include "common/request.h"
#include "transport/inter_host.h"
#include "transport/shm/segment.h"

namespace fastxfer {

struct EngineConfig {
  size_t bucket_cap_bytes = 25u << 20;
  int max_records = 1024;       // requests agreed per round (the segment carries this many)
  double hold_us = 2000;        // held requests (Engine::submit) run after this long without a submit
  std::vector<int> cpus;        // pin the engine thread to these CPUs (empty: no pinning)
  std::string timeline_path;    // FASTXFER_TIMELINE (empty: no timeline)
  int timeline_rank = 0;        // the rank the timeline names (its Chrome-trace pid)
  double clock_offset_us = 0;   // this rank's steady clock to rank 0's (timeline.h)
  bool timeline_mark_cycles = false;
  std::vector<int> rank_names;  // the job rank of each of the engine's ranks, for messages (empty: the
                                // same numbers; a process set's differ)
  size_t eager_bytes = 32u << 10;  // allreduce buckets up to this many packed bytes travel with the records
                                   // (FASTXFER_EAGER_KB; 0: never; capped by Collectives::eager_capacity)
  bool eager_tune = true;       // the tuner picks the path per size below eager_bytes (FASTXFER_EAGER_TUNE;
                                // false: every such bucket takes the one-exchange path)
  bool yield_on_wake = true;    // a submit that wakes the sleeping engine thread yields the core to it
                                // (FASTXFER_YIELD; docs/architecture.md, "Waking the engine thread")
};

enum class ErrorKind : int { kNone = 0, kPeerFailure, kMismatch, kEngine, kInvalid };

struct Request;
// Completion callback of a request nobody waits for (the TensorFlow ops, engine/c_api.h): called
// exactly once, without the engine's lock, on the thread running the round (the engine thread or a
// waiter driving it, see Engine::wait) or on the thread that stops a failed engine, with the request still intact (an allgather's result readable); the engine
// forgets the request as soon as it returns.
using DoneCallback = std::function<void(Request&, ErrorKind, const std::string&)>;

struct Request {
  uint64_t id = 0;
  CollectiveKind kind = CollectiveKind::kBarrier;
  DType dtype = DType::kFloat32;
  size_t numel = 0;
  ReduceOp op = ReduceOp::kSum;
  Compression compression = Compression::kNone;
  int root = 0;
  double prescale = 1.0, postscale = 1.0;
  int64_t group = 0;  // allreduce: fusion group (0: none); requests of different groups never share a bucket
  const void* in = nullptr;
  void* out = nullptr;
  Record rec{};
  std::vector<char> gathered;  // allgather/alltoall result (its size is only known once ranks agree);
                               // reducescatter's when `out` is null
  int64_t gathered_rows = 0;
  std::vector<int64_t> splits;       // alltoall: rows sent to each rank (empty: an equal split)
  std::vector<int64_t> recv_splits;  // alltoall: rows received from each rank (after it ran)
  DoneCallback on_done;  // set: nobody calls wait()/release() for this request
  bool tracked = true;    // reported by take_finished() (false: the caller holds its buffers and
                          // waits at once, the binding's run(): nothing to drop once it finished)
  bool stand_in = false;  // made up by a joined rank to match its peers' allreduce (see join)
  std::vector<char> stand_in_buf;  // its input (the op's neutral element) and output
  int joined_last = -1;   // join: the rank that joined last
  double t_submit = 0, t_agreed = 0;  // timeline clock (only when the timeline is on)
};

class Engine {
 public:
  Engine(std::unique_ptr<Collectives> comm, const EngineConfig& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }

  // Queues a request (its `id` is assigned here) and returns at once. Throws the engine's error
  // if it has already failed. `defer`: do not wake the engine thread, because the caller is about
  // to wait() for the request and will run it itself (a synchronous call). `hold`: more requests
  // of the same group follow at once (a grouped allreduce's submits before the last of a bucket):
  // queue it without waking the engine thread and without letting it start a round for it, so that
  // the group is negotiated in one round instead of one round per tensor. The next submit without
  // `hold` releases every held request; so do a waiter, and the engine thread itself once nothing
  // was submitted for `EngineConfig::hold_us` (a group whose last submit never comes; for an
  // explicit fusion group, Request::group, kGroupHoldLimit: a preempted submitter must not cut it).
  uint64_t submit(Request req, bool defer = false, bool hold = false);
  // Blocks until request `id` is done; throws its error. Call without holding the GIL. When no
  // round is running, the calling thread runs the next one itself instead of waking the engine
  // thread (so a synchronous collective costs no thread hand-off).
  void wait(uint64_t id);
  bool done(uint64_t id);
  // Requests the engine still tracks: queued, running, or finished but not yet waited for.
  size_t tracked() const {
    std::lock_guard<std::mutex> lk(mu_);
    return status_.size();
  }
  // Ids finished (or failed) since the last call: their buffers may be released.
  std::vector<uint64_t> take_finished();
  // A finished join's result: the rank that joined last.
  int joined_last(uint64_t id);
  // Moves out an allgather/alltoall/reducescatter result (after wait); `splits`, when given,
  // receives an alltoall's received splits.
  std::vector<char> take_gathered(uint64_t id, int64_t* rows, std::vector<int64_t>* splits = nullptr);
  // Forgets a waited-for request.
  void release(uint64_t id);
  // Nobody will wait for request `id` (its handle was dropped): forget it as soon as it finishes,
  // so an unwaited handle leaks nothing (an allgather's result is freed with it).
  void detach(uint64_t id);

  // Runs on the calling thread, on the collectives' out-of-band lane.
  void oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                     double postscale);
  size_t oob_capacity() const { return comm_->oob_capacity(); }

  // The job rank of the engine's rank j (what messages name).
  int job_rank(int j) const;
  // Collective: every rank must call it. Drains the queue, then stops the thread.
  void shutdown();
  // Not collective: stop now, telling the peers this rank left (`why`); a peer that waits for it
  // then fails at once. What the destructor does, on demand (a process set's engine at exit).
  void leave(const std::string& why);
  bool running() const;
  // A host of the job was lost: a network call may still be running on a thread of its own.
  bool host_lost() const { return comm_->host_lost(); }
  // Read while the engine runs: approximate (not synchronised with the engine thread).
  CommStats stats() const { return comm_->stats(); }
  // The one-exchange path's tuner: what it measured per size class, and switching it off or on
  // (off: every bucket within eager_bytes takes that path, as before the tuner).
  std::vector<EagerTuner::Row> eager_tuning() const { return tuner_.rows(); }
  void set_eager_tuning(bool on) { tuner_.set_enabled(on); }
  // For `fastxfer run`'s last line: this rank fails because of job rank `job_culprit` (`kind`:
  // "stalled", "finished", "failed"); the first culprit a rank names stands (ShmSegment::report).
  void report(int job_culprit, const std::string& kind, const std::string& msg) { comm_->report(job_culprit, kind, msg); }
  // A step mark on the timeline (no-op without one).
  void mark(const std::string& name) { timeline_.mark(name); }
  bool timeline_enabled() const { return timeline_.enabled(); }
  // hvd.start_timeline / stop_timeline: this rank's part of the job's timeline (fastxfer.comm.timeline).
  void start_timeline(const std::string& path, bool mark_cycles) { timeline_.start(path, mark_cycles); }
  void stop_timeline() { timeline_.close(); }

 private:
  struct Status {
    bool finished = false;
    ErrorKind error = ErrorKind::kNone;
    std::string message;
    bool detached = false;  // see detach()
    int joined_last = -1;   // a finished join's result
  };

  // engine.cc: the thread, the rounds, the handles.
  void loop();
  bool run_round();
  void fail_from(ErrorKind kind, const std::string& msg);  // fail everything and tell the peers
  void fail_front(ErrorKind kind, const std::string& msg);  // fail the queue's first request alone
  void fail_from_current();  // fail_from() for the exception being handled (call in a catch block)
  void finish(Request* r);
  void fail_all(ErrorKind kind, const std::string& msg);
  // Fails every callback request still queued or running (after the thread stopped).
  void fail_callbacks(ErrorKind kind, const std::string& msg);
  [[noreturn]] void throw_error(ErrorKind kind, const std::string& msg) const;
  // EngineError in a forked child of the process that started the engine.
  void check_process() const;
  // dispatch.cc: the per-kind rules checked at submit, running an agreed batch, its timeline spans.
  void check_shape(Request& req) const;
  // Runs batch[start..]: the requests before `start` ran already (the one-exchange path).
  void run_batch(const std::vector<Request*>& batch, const std::vector<std::vector<Record>>& all, size_t start = 0);
  // The one-exchange path: how many of `offered` (this round's requests, in order) form one small
  // allreduce bucket that can travel with the records, and that bucket's job (dispatch.cc).
  // `bytes` (if given): that bucket's packed bytes.
  size_t eager_prefix(const std::vector<Request*>& offered, size_t* bytes = nullptr) const;
  // (into `bucket` and `job`, whose storage is reused)
  void eager_job(const std::vector<Request*>& reqs, size_t n, Bucket& bucket, AllreduceJob& job) const;
  // Runs the first n requests of `batch` from the data that came with the records and finishes them;
  // `b` and `job` are the offered bucket's (its requests are the batch's first ones), cut to those n.
  void run_eager(const std::vector<Request*>& batch, size_t n, Bucket& b, AllreduceJob& job);
  // Timeline spans of one request that ran from t0 to t1 (before finish(r)).
  void trace(const Request& r, double t0, double t1, const std::string& bucket);
  // join.cc: a joined rank's stand-ins for the allreduces its peers still run.
  std::vector<std::unique_ptr<Request>> stand_ins(const std::vector<Record>& recs, size_t n);

  // Recycled storage (under mu_): the map entries and Request objects of requests that are gone
  // serve the next ones, so a small synchronous allreduce allocates nothing in the engine
  // (docs/architecture.md, "Small allreduces"). Bounded: a burst of requests frees the excess.
  using StatusMap = std::unordered_map<uint64_t, Status>;
  using ActiveMap = std::unordered_map<uint64_t, std::unique_ptr<Request>>;
  std::unique_ptr<Request> new_request_locked(Request&& req);
  void new_status_locked(uint64_t id);
  void make_active_locked(std::unique_ptr<Request> r);
  // Forgets request `id` (its status and, when agreed, its Request), keeping the storage.
  void forget_locked(StatusMap::iterator it);
  static constexpr size_t kSpares = 64;
  std::vector<StatusMap::node_type> spare_status_;
  std::vector<ActiveMap::node_type> spare_active_;   // entries whose Request moved to spare_requests_
  std::vector<std::unique_ptr<Request>> spare_requests_;
  // One round's working storage, kept between rounds (only the thread driving a round uses it).
  struct RoundScratch {
    std::vector<Record> recs;
    std::vector<Request*> offered;
    std::vector<std::vector<Record>> all;
    std::vector<int> active;
    std::vector<Request*> batch;
    Bucket eager_bucket{};
    AllreduceJob eager_run{};
    std::vector<TensorSpec> specs;  // run_batch's fused runs: their tensors, buckets and job
    std::vector<Bucket> plan;
    AllreduceJob run{};
  };
  RoundScratch round_;
  EagerTuner tuner_;

  std::unique_ptr<Collectives> comm_;
  EngineConfig cfg_;
  Timeline timeline_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::unique_ptr<Request>> queue_;                   // submitted, not yet agreed
  ActiveMap active_;  // agreed or finished, not yet waited
  StatusMap status_;
  std::vector<uint64_t> finished_;
  uint64_t next_id_ = 1;
  uint64_t executed_ = 0;
  std::vector<uint64_t> joined_at_;  // join: per rank, the round (1-based) it joined in; 0: not joined
  uint64_t rounds_run_ = 0;
  uint64_t buckets_ = 0;   // buckets run so far (timeline labels)  // requests agreed and run (the same count on every rank)
  bool stop_ = false, stopped_ = false, shutdown_requested_ = false;
  bool driving_ = false;  // a thread (engine or waiter) is running a round: only one at a time
  bool engine_sleeping_ = false;  // the engine thread waits for work
  size_t held_ = 0;  // the last held_ requests of queue_ were submitted with `hold` and not released yet
  std::chrono::steady_clock::time_point held_since_;  // the latest held submit
  bool held_grouped_ = false;  // the latest held submit belongs to an explicit fusion group (Request::group):
                               // held up to kGroupHoldLimit, not hold_us (a group is one run, docs/architecture.md)
  ErrorKind fatal_ = ErrorKind::kNone;
  std::string fatal_msg_;
  std::mutex oob_mu_;
  int owner_pid_;  // the process that started the engine (a fork's copy must not use it)
  uint64_t owner_fork_generation_;  // fork_generation() there (common/process.h)
  std::thread thread_;
};

// Everything a process needs to join the job's collectives (what fastxfer.init() gathered; every
// value the environment sets arrives here from fastxfer.settings: the core reads no environment).
struct JobConfig {
  ShmConfig shm;                       // this host's segment
  int threads = 1;                     // pack/unpack threads inside one chunk
  size_t stream_min_bytes = 4u << 20;  // buckets with outputs this large use streaming stores
  size_t net_chunk_bytes = 1u << 20;   // several hosts: allreduce chunks overlapped with the network
                                       // hold at most this on the wire (0: no overlap)
  double host_timeout_s = 0;           // several hosts: heartbeat deadline (0: no heartbeats)
  std::string host_id;                 // several hosts emulated on one machine: this host's id
  bool host_leader = true;             // one rank per host crosses for the agreement rounds
                                       // (FASTXFER_HOST_ID; empty: a real host)
  EngineConfig engine;
};

// Joins the job and starts the engine thread: shared memory among this host's ranks, plus the
// hierarchical algorithms over `inter` when the job spans several hosts (inter != nullptr).
// Blocks until every local rank has attached. The engine is never destroyed in a forked child.
std::shared_ptr<Engine> start_engine(const JobConfig& job, std::shared_ptr<InterHost> inter);

// The engine that the C interface (engine/c_api.h) submits to: fastxfer.init() makes its engine
// current, shutdown() clears it (nullptr), after which C submissions fail with FX_NOT_INITIALIZED.
void set_current_engine(std::shared_ptr<Engine> eng);
// The engine of process set `id` (> 0) that the C interface submits to; null forgets it.
void set_process_set_engine(int id, std::shared_ptr<Engine> eng);
const fx_engine_api* engine_c_api();

}  // namespace fastxfer
