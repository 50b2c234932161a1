// Engine: one background thread per process.
//
// Why one thread, and how ranks agree on order (the rule that cannot deadlock):
// Every rank's program issues collectives in the same order (as with Horovod or PyTorch DDP;
// Keras computes gradients in a fixed order). Requests are numbered by arrival. In each round the
// thread publishes the descriptors of the requests it has queued (up to max_records), reads every
// rank's list, and runs the longest prefix that every rank has — min over ranks. Because that
// prefix is identical everywhere, every rank runs the same collectives, fused into the same
// buckets, in the same order, and never waits for something a peer will not send. Descriptors
// are compared element by element first: a different name, shape, dtype, op or order is a
// Mismatch on every rank (they all see the same lists), never a hang or a wrong sum. Requests that
// arrive while a round runs wait for the next round, which fuses whatever has accumulated — so
// gradients produced during the backward pass are reduced while the rest are still computed.
// A single thread keeps the collectives' sequence counters in lock-step without any locking.
//
// This file: the thread, the queue, the rounds and the handles. What each kind of collective does
// once agreed is dispatch.cc; a joined rank's stand-ins for its peers' allreduces are join.cc.
#include "engine/engine.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "collectives/hierarchical.h"
#include "common/process.h"
#include "collectives/shm_collectives.h"
#include "common/errors.h"
#include "common/waiting.h"

namespace fastxfer {

Engine::Engine(std::unique_ptr<Collectives> comm, const EngineConfig& cfg)
    : comm_(std::move(comm)), cfg_(cfg), timeline_(cfg.timeline_path, cfg.timeline_rank, cfg.clock_offset_us, cfg.timeline_mark_cycles), owner_pid_(getpid()),
      owner_fork_generation_(fork_generation()) {
  tuner_.set_enabled(cfg_.eager_tune);
  thread_ = std::thread([this] { loop(); });
  pthread_setname_np(thread_.native_handle(), "fastxfer-engine");  // visible in top -H, gdb, /proc
  if (!cfg_.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : cfg_.cpus) CPU_SET(c, &set);
    int rc = pthread_setaffinity_np(thread_.native_handle(), sizeof(set), &set);
    if (rc != 0) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
      }
      comm_->abort();
      work_cv_.notify_all();
      thread_.join();
      throw EngineError("cannot pin the engine thread to the given CPUs: " + std::string(std::strerror(rc)));
    }
  }
}

void Engine::check_process() const {
  if (fork_generation() != owner_fork_generation_)
    throw EngineError("fastxfer was initialised in process " + std::to_string(owner_pid_) +
                      ", and this process is a fork of it: a forked child cannot take part in the parent's "
                      "collectives. Run them in the parent, or start the child with the 'spawn' start method "
                      "and call fastxfer.init() there as a rank of its own job");
}

Engine::~Engine() {
  leave("the process left without calling shutdown()");
  fail_callbacks(ErrorKind::kEngine, "fastxfer's engine was destroyed before this collective ran");
}

void Engine::leave(const std::string& why) {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  comm_->abort();
  work_cv_.notify_all();
  thread_.join();
  if (fatal_ == ErrorKind::kNone) comm_->mark_exited(false, why.c_str());
  timeline_.close();
  fail_callbacks(ErrorKind::kEngine, "fastxfer's engine stopped (" + why + ") before this collective ran");
}

int Engine::job_rank(int j) const {
  const auto& names = cfg_.rank_names;
  return j >= 0 && j < static_cast<int>(names.size()) ? names[j] : j;
}

void Engine::throw_error(ErrorKind kind, const std::string& msg) const {
  switch (kind) {
    case ErrorKind::kPeerFailure: throw PeerFailure(msg);
    case ErrorKind::kMismatch: throw Mismatch(msg);
    case ErrorKind::kInvalid: throw std::invalid_argument(msg);
    default: throw EngineError(msg);
  }
}

uint64_t Engine::submit(Request req, bool defer, bool hold) {
  // Invariants the bucket planner relies on (fastxfer/_validate.py gives users the friendly message).
  if (req.compression != Compression::kNone && req.dtype != DType::kFloat32)
    throw std::invalid_argument(std::string("compression applies to float32 tensors, not ") + dtype_name(req.dtype));
  if (req.rec.bucket_cap < 0) throw std::invalid_argument("bucket_cap must be >= 0 bytes");
  check_process();
  check_shape(req);
  bool woke = false;
  // The cap decides which tensors share a bucket, so it is part of what ranks agree on: a rank
  // whose default differs fails with a Mismatch naming both caps instead of fusing differently.
  if (req.kind == CollectiveKind::kAllreduce && req.rec.bucket_cap == 0)
    req.rec.bucket_cap = static_cast<int64_t>(cfg_.bucket_cap_bytes);
  std::unique_lock<std::mutex> lk(mu_);
  if (fatal_ != ErrorKind::kNone) throw_error(fatal_, fatal_msg_);
  if (shutdown_requested_ || stopped_) throw EngineError("fastxfer has been shut down; call init() again first");
  req.id = next_id_++;
  const int64_t req_group = req.group;
  if (req.kind == CollectiveKind::kShutdown) shutdown_requested_ = true;
  if (timeline_.enabled()) req.t_submit = timeline_.now();
  uint64_t id = req.id;
  new_status_locked(id);
  queue_.push_back(new_request_locked(std::move(req)));
  comm_->set_engine_idle(false);
  if (hold) {
    // Not woken (waking it for the first of a group was measured to cost more than the round it
    // saves, the woken thread taking the core), and ready() tells it to leave held requests alone.
    held_since_ = std::chrono::steady_clock::now();
    held_grouped_ = req_group != 0;
    ++held_;
    return id;
  }
  held_ = 0;  // this submit releases the group held before it
  if (!defer) {
    work_cv_.notify_one();
    woke = engine_sleeping_;
  }
  lk.unlock();
  // The engine thread slept with nothing to do: give it this core now, so that it publishes the
  // round while the peers wait, instead of whenever the scheduler gets to it (measured: up to
  // ~170 us later on a worker with one core, docs/architecture.md).
  if (woke && cfg_.yield_on_wake) sched_yield();
  return id;
}

void Engine::wait(uint64_t id) {
  check_process();
  std::unique_lock<std::mutex> lk(mu_);
  auto unknown = [&] { return std::invalid_argument("unknown or already released handle " + std::to_string(id)); };
  if (status_.find(id) == status_.end()) throw unknown();
  // While my request is not done: if nobody is running a round, run it here instead of handing it
  // to the engine thread and sleeping until it hands the result back. A synchronous call then
  // costs no thread hand-off at all (two context switches, each a scheduler wait on a busy
  // machine: docs/architecture.md, "Who runs a round").
  for (;;) {
    // Look the entry up afresh after each wake-up: another thread may have released it.
    auto it = status_.find(id);
    if (it == status_.end() || it->second.finished) break;
    if (!driving_ && !queue_.empty() && fatal_ == ErrorKind::kNone && !stop_ && !stopped_) {
      held_ = 0;  // somebody waits: nothing is held back any more
      driving_ = true;
      lk.unlock();
      try {
        const OwnResultWait own;  // this thread has nothing else to do: its waits may spin longer
        run_round();  // after the shutdown round the queue stays empty; shutdown() stops the thread
      } catch (...) {
        fail_from_current();
      }
      lk.lock();
      driving_ = false;
      // The engine thread may sleep through this (nothing queued): the out-of-band lane's
      // mismatch check reads this flag, so it must say so now, not at the engine's next wake-up.
      comm_->set_engine_idle(queue_.empty());
      // The engine thread takes over whatever is queued now. With nothing queued (every
      // synchronous call) it is left asleep: waking it only to find no work cost a context switch
      // per call on this thread's core, and with unbound ranks sometimes on the peer's core
      // (docs/architecture.md, "Who runs a round").
      if (!queue_.empty()) work_cv_.notify_one();
      continue;
    }
    done_cv_.wait(lk);
  }
  auto it = status_.find(id);
  if (it == status_.end()) throw unknown();
  if (it->second.error != ErrorKind::kNone) throw_error(it->second.error, it->second.message);
}

bool Engine::done(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = status_.find(id);
  return it == status_.end() || it->second.finished;
}

std::vector<uint64_t> Engine::take_finished() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<uint64_t> out;
  out.swap(finished_);
  return out;
}

std::vector<char> Engine::take_gathered(uint64_t id, int64_t* rows, std::vector<int64_t>* splits) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = active_.find(id);
  if (it == active_.end()) throw std::invalid_argument("no allgather result for handle " + std::to_string(id));
  *rows = it->second->gathered_rows;
  if (splits) *splits = std::move(it->second->recv_splits);
  return std::move(it->second->gathered);
}

void Engine::detach(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = status_.find(id);
  if (it == status_.end()) return;
  if (it->second.finished) {
    status_.erase(it);
    active_.erase(id);
  } else {
    it->second.detached = true;
  }
}

void Engine::release(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = status_.find(id);
  if (it != status_.end() && it->second.finished) forget_locked(it);
}

std::unique_ptr<Request> Engine::new_request_locked(Request&& req) {
  if (spare_requests_.empty()) return std::make_unique<Request>(std::move(req));
  std::unique_ptr<Request> r = std::move(spare_requests_.back());
  spare_requests_.pop_back();
  *r = std::move(req);
  return r;
}

void Engine::new_status_locked(uint64_t id) {
  if (spare_status_.empty()) {
    status_[id] = Status{};
    return;
  }
  StatusMap::node_type node = std::move(spare_status_.back());
  spare_status_.pop_back();
  node.key() = id;
  node.mapped() = Status{};
  status_.insert(std::move(node));
}

void Engine::make_active_locked(std::unique_ptr<Request> r) {
  const uint64_t id = r->id;
  if (spare_active_.empty()) {
    active_[id] = std::move(r);
    return;
  }
  ActiveMap::node_type node = std::move(spare_active_.back());
  spare_active_.pop_back();
  node.key() = id;
  node.mapped() = std::move(r);
  active_.insert(std::move(node));
}

void Engine::forget_locked(StatusMap::iterator it) {
  const uint64_t id = it->first;
  if (spare_status_.size() < kSpares) spare_status_.push_back(status_.extract(it));
  else status_.erase(it);
  auto a = active_.find(id);
  if (a == active_.end()) return;
  if (spare_active_.size() >= kSpares) {
    active_.erase(a);
    return;
  }
  ActiveMap::node_type node = active_.extract(a);
  std::unique_ptr<Request> r = std::move(node.mapped());
  spare_active_.push_back(std::move(node));
  if (r && spare_requests_.size() < kSpares) {
    *r = Request{};  // its buffers (an allgather's result) go now, not when the storage is reused
    spare_requests_.push_back(std::move(r));
  }
}

bool Engine::running() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !stopped_ && fatal_ == ErrorKind::kNone;
}

void Engine::finish(Request* r) {
  if (r->stand_in) return;  // owned by the round that made it
  if (r->on_done) {
    std::unique_ptr<Request> owned;
    {
      std::lock_guard<std::mutex> lk(mu_);
      status_.erase(r->id);
      auto it = active_.find(r->id);
      owned = std::move(it->second);
      active_.erase(it);
    }
    owned->on_done(*owned, ErrorKind::kNone, std::string());
    return;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (r->tracked) finished_.push_back(r->id);
  auto it = status_.find(r->id);
  if (it != status_.end() && it->second.detached) {  // nobody will wait: forget it now
    forget_locked(it);
    return;
  }
  Status& st = it != status_.end() ? it->second : status_[r->id];
  st.finished = true;
  st.joined_last = r->joined_last;
  done_cv_.notify_all();
}

int Engine::joined_last(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = status_.find(id);
  if (it == status_.end() || !it->second.finished) throw std::invalid_argument("join " + std::to_string(id) + " is not done");
  return it->second.joined_last;
}

void Engine::fail_callbacks(ErrorKind kind, const std::string& msg) {
  std::vector<std::unique_ptr<Request>> orphans;
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::deque<std::unique_ptr<Request>> keep;
    for (auto& r : queue_) {
      if (r->on_done) {
        status_.erase(r->id);
        orphans.push_back(std::move(r));
      } else {
        keep.push_back(std::move(r));
      }
    }
    queue_.swap(keep);
    held_ = 0;
    for (auto it = active_.begin(); it != active_.end();) {
      if (it->second->on_done) {
        status_.erase(it->first);
        orphans.push_back(std::move(it->second));
        it = active_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& r : orphans) r->on_done(*r, kind, msg);
}

void Engine::fail_all(ErrorKind kind, const std::string& msg) {
  ErrorKind first;
  std::string first_msg;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (fatal_ == ErrorKind::kNone) {
      fatal_ = kind;
      fatal_msg_ = msg;
    }
    first = fatal_;
    first_msg = fatal_msg_;
    for (auto it = status_.begin(); it != status_.end();) {
      if (!it->second.finished) {
        finished_.push_back(it->first);
        if (it->second.detached && active_.count(it->first)) {
          // Nobody waits for it, and the engine thread no longer runs it: forget it. (A detached
          // request still queued keeps its entry until the queue is dropped with the engine.)
          active_.erase(it->first);
          it = status_.erase(it);
          continue;
        }
        it->second.finished = true;
        it->second.error = fatal_;
        it->second.message = fatal_msg_;
      }
      ++it;
    }
    done_cv_.notify_all();
  }
  work_cv_.notify_all();  // the engine thread stops
  fail_callbacks(first, first_msg);
}

// One negotiation round and the batch it agrees on, on whichever thread holds `driving_`: the
// engine thread, or a thread waiting for its own request (see wait()). Returns whether the batch
// ended with the shutdown request. Throws what the collectives throw.
bool Engine::run_round() {
  const bool tl = timeline_.enabled();
  std::vector<Record>& recs = round_.recs;
  std::vector<Request*>& offered = round_.offered;
  recs.clear();
  offered.clear();
  {
    std::lock_guard<std::mutex> lk(mu_);
    // A round that starts while an explicit fusion group is half submitted leaves its held part
    // queued: taking it would cut the group in two rounds, hence two buckets (measured on 3 ranks:
    // the round released by one group took the next group's first tensor). Other held runs may go
    // early: they only save rounds.
    const size_t held_group = held_grouped_ ? std::min(held_, queue_.size()) : 0;
    size_t m = std::min(queue_.size() - held_group, static_cast<size_t>(cfg_.max_records));
    recs.reserve(m);
    offered.reserve(m);
    for (size_t i = 0; i < m; ++i) {
      recs.push_back(queue_[i]->rec);
      offered.push_back(queue_[i].get());
    }
  }
  if (recs.empty()) return false;
  const double t_round = tl ? timeline_.now() : 0;
  if (tl) timeline_.cycle();
  // Small allreduces at the head of the round send their data with the records (every rank offers,
  // if only none): the requests stay queued, this thread alone takes them off the queue.
  // The offered bucket is kept for run_eager: the batch starts with the same requests.
  // Whether this rank offers it is the tuner's call (eager_tuner.h): measured per size, on both paths.
  size_t offer_bytes = 0;
  const size_t full = eager_prefix(offered, &offer_bytes);
  const size_t offer = full > 0 && tuner_.offer(offer_bytes, rounds_run_) ? full : 0;
  const bool timed = full > 0 && tuner_.enabled();
  const auto t_offer = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  Bucket& eager_bucket = round_.eager_bucket;
  AllreduceJob& eager_run = round_.eager_run;
  if (offer > 0) {
    eager_job(offered, offer, eager_bucket, eager_run);
    comm_->eager_offer(&eager_run, static_cast<uint32_t>(offer));
  } else if (comm_->eager_capacity() > 0) {
    comm_->eager_offer(nullptr, 0);
  }
  std::vector<std::vector<Record>>& all = round_.all;
  comm_->exchange_records(recs, all);
  ++rounds_run_;
  const int n = static_cast<int>(all.size());
  // join: a rank whose next request is a join has no more data; it stands in for its peers'
  // allreduces with the op's neutral element until every rank has joined.
  auto joined = [&](int j) {
    return !all[j].empty() && static_cast<CollectiveKind>(all[j][0].kind) == CollectiveKind::kJoin;
  };
  std::vector<int>& active = round_.active;
  active.clear();
  for (int j = 0; j < n; ++j) {
    if (joined(j)) {
      if (joined_at_.size() != all.size()) joined_at_.assign(all.size(), 0);
      if (!joined_at_[j]) joined_at_[j] = rounds_run_;
    } else {
      active.push_back(j);
    }
  }
  size_t agreed = recs.size();
  if (active.empty() || active.size() == all.size()) {
    for (const auto& l : all) agreed = std::min(agreed, l.size());
    if (active.empty()) agreed = 1;  // everyone has joined: the join itself
  } else {
    // the active ranks' common prefix, up to the first join any of them has queued
    agreed = all[active[0]].size();
    for (int j : active) {
      size_t k = 0;
      while (k < all[j].size() && static_cast<CollectiveKind>(all[j][k].kind) != CollectiveKind::kJoin) ++k;
      agreed = std::min(agreed, k);
    }
  }
  if (tl) {
    const double t = timeline_.now();
    timeline_.span(Timeline::kEngineLane, "engine", "negotiate", t_round, t,
                   "\"offered\": " + std::to_string(recs.size()) + ", \"agreed\": " + std::to_string(agreed));
  }
  // A collective the ranks disagree on fails alone, as in Horovod: every rank sees the same
  // records, so every rank finds the same first disagreement; the agreed requests before it run,
  // it fails with MismatchError on each rank that submitted it, and the engine goes on.
  size_t bad = agreed;
  std::string bad_msg;
  if (!active.empty()) {
    const int ref = active[0];
    for (size_t i = 0; i < agreed && bad == agreed; ++i) {
      for (int j : active) {
        if (j == ref) continue;
        // A rank that shut down (its script ended, or it called shutdown()) while another still
        // submits collectives has left the job: a peer failure on the ranks still running, named
        // to the launcher (not a disagreement between them: in an elastic job, a departure).
        const bool ref_down = static_cast<CollectiveKind>(all[ref][i].kind) == CollectiveKind::kShutdown;
        const bool j_down = static_cast<CollectiveKind>(all[j][i].kind) == CollectiveKind::kShutdown;
        if (ref_down != j_down) {
          const int gone = ref_down ? ref : j, still = ref_down ? j : ref;
          const std::string msg =
              "rank " + std::to_string(job_rank(gone)) + " finished (its script ended, or it called shutdown()) " +
              "while rank " + std::to_string(job_rank(still)) + " still submitted " + describe(all[still][i]) +
              " (collective #" + std::to_string(executed_ + i + 1) + "): every rank must run the same " +
              "collectives before it finishes";
          if (static_cast<CollectiveKind>(all[comm_->rank()][i].kind) != CollectiveKind::kShutdown)
            comm_->report(job_rank(gone), "finished", msg);
          throw PeerFailure(msg);
        }
        std::string diff = compare_records(all[ref][i], job_rank(ref), all[j][i], job_rank(j));
        // Different names: the ranks issue different sequences of collectives (one has more, or
        // another order). Matched by position, nothing after this lines up again: the group is
        // poisoned, every rank fails, as before.
        if (!diff.empty() && std::strncmp(all[ref][i].name, all[j][i].name, sizeof all[ref][i].name) != 0)
          throw Mismatch("collective #" + std::to_string(executed_ + i + 1) + ": " + diff +
                         ". Every rank must issue the same collectives, with the same names, shapes, "
                         "dtypes and options, in the same order.");
        if (!diff.empty()) {
          bad = i;
          bad_msg = "collective #" + std::to_string(executed_ + i + 1) + ": " + diff +
                    ". Every rank must issue the same collectives, with the same names, shapes, "
                    "dtypes and options, in the same order.";
          break;
        }
      }
      if (bad == agreed && active.size() < all.size() &&
          static_cast<CollectiveKind>(all[ref][i].kind) != CollectiveKind::kAllreduce) {
        std::string who;
        for (int j = 0; j < n; ++j)
          if (joined(j)) who += (who.empty() ? "" : ", ") + std::to_string(job_rank(j));
        bad = i;
        bad_msg = "collective #" + std::to_string(executed_ + i + 1) + ": rank " + std::to_string(job_rank(ref)) +
                  " submitted " + describe(all[ref][i]) + " but rank(s) " + who +
                  " have joined: while some ranks have joined, the others may only run allreduces";
      }
    }
  }
  const bool failing = bad < agreed;
  agreed = bad;
  // the disagreement, once the requests agreed before it have run (a joined rank has no part in it)
  auto fail_bad = [&] {
    if (!failing) return;
    if (!joined(comm_->rank())) fail_front(ErrorKind::kMismatch, bad_msg);
    ++executed_;
  };
  if (agreed == 0) {
    fail_bad();
    return false;
  }
  if (agreed == 0) return false;
  const bool me_joined = joined(comm_->rank()) && !active.empty();
  std::vector<std::unique_ptr<Request>> stand;
  std::vector<Request*>& batch = round_.batch;
  batch.clear();
  if (me_joined) {
    stand = stand_ins(all[active[0]], agreed);
    for (auto& r : stand) batch.push_back(r.get());
  } else {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < agreed; ++i) {
      Request* r = queue_.front().get();
      make_active_locked(std::move(queue_.front()));
      queue_.pop_front();
      batch.push_back(r);
      if (tl) r->t_agreed = timeline_.now();
    }
    held_ = std::min(held_, queue_.size());  // held requests are the queue's tail: some may have run
  }
  if (active.empty()) {
    // The join completes: the rank that joined last (the latest round; the highest rank of a tie).
    int last_rank = 0;
    for (int j = 0; j < n; ++j)
      if (joined_at_[j] >= joined_at_[last_rank]) last_rank = j;
    batch[0]->joined_last = last_rank;
    joined_at_.assign(all.size(), 0);
  }
  // Read before running: once a request is finished, the waiting thread may release it.
  const bool last = batch.back()->kind == CollectiveKind::kShutdown;
  // The agreed prefix every rank offered (a joined rank offers none, so stand-ins never go here).
  size_t eager = 0;
  if (comm_->eager_capacity() > 0 && !me_joined) eager = std::min<size_t>(agreed, comm_->eager_agreed());
  if (eager > 0) run_eager(batch, eager, eager_bucket, eager_run);
  run_batch(batch, all, eager);
  // A round that was the offered bucket and nothing else times one path for the tuner.
  if (timed && agreed == full && !failing && !me_joined && (eager == 0 || eager == agreed))
    tuner_.record(offer_bytes, eager > 0,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t_offer).count());
  executed_ += agreed;
  fail_bad();
  return last;
}

void Engine::fail_front(ErrorKind kind, const std::string& msg) {
  std::unique_ptr<Request> r;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (queue_.empty()) return;
    r = std::move(queue_.front());
    queue_.pop_front();
    held_ = std::min(held_, queue_.size());
    if (r->on_done) {
      status_.erase(r->id);
    } else {
      auto it = status_.find(r->id);
      if (it != status_.end() && it->second.detached) {
        status_.erase(it);  // nobody waits for it
      } else if (it != status_.end()) {
        it->second.finished = true;
        it->second.error = kind;
        it->second.message = msg;
        finished_.push_back(r->id);
        active_[r->id] = std::move(r);  // its buffers stay the caller's until release()
      }
      done_cv_.notify_all();
    }
  }
  if (r && r->on_done) r->on_done(*r, kind, msg);
}

void Engine::fail_from(ErrorKind kind, const std::string& msg) {
  fail_all(kind, msg);
  comm_->mark_exited(false, msg.c_str(), kind == ErrorKind::kMismatch);
}

void Engine::fail_from_current() {
  try {
    throw;
  } catch (const PeerFailure& e) {
    fail_from(ErrorKind::kPeerFailure, e.what());
  } catch (const Mismatch& e) {
    fail_from(ErrorKind::kMismatch, e.what());
  } catch (const std::exception& e) {
    fail_from(ErrorKind::kEngine, e.what());
  } catch (...) {
    fail_from(ErrorKind::kEngine, "unknown error in a collective round");
  }
}

void Engine::loop() {
  try {
    for (;;) {
      const bool tl = timeline_.enabled();
      double t_idle = tl ? timeline_.now() : 0;
      {
        std::unique_lock<std::mutex> lk(mu_);
        // Held requests (submit's `hold`) wait for the submit that releases them, or for a pause
        // of hold_us in their group's submits: a group whose last submit never comes (a step
        // that failed half-way) still runs. A held submit does not wake this thread, so an idle
        // one looks every kIdleCheck whether something was held meanwhile.
        auto ready = [&] { return (queue_.size() > held_ && !driving_) || stop_ || fatal_ != ErrorKind::kNone; };
        constexpr auto kIdleCheck = std::chrono::milliseconds(50);
        // An explicit group (Horovod's groups=) is one run by definition: its submits come back to
        // back, but a submitter preempted for longer than hold_us (measured: 3 ranks on 2 busy
        // cores) would otherwise cut it in two rounds, hence two buckets. Its limit only matters
        // when its last submit never comes (a step that failed half-way).
        constexpr auto kGroupHoldLimit = std::chrono::seconds(1);
        const auto hold_us = std::chrono::microseconds(static_cast<int64_t>(cfg_.hold_us));
        auto hold_for = [&] {
          return held_grouped_ ? std::chrono::duration_cast<std::chrono::microseconds>(kGroupHoldLimit) : hold_us;
        };
        while (!ready()) {
          comm_->set_engine_idle(queue_.empty() && !driving_);
          engine_sleeping_ = true;
          if (held_ == 0) {
            work_cv_.wait_for(lk, kIdleCheck);
          } else {
            work_cv_.wait_until(lk, held_since_ + hold_for());
            if (held_ > 0 && std::chrono::steady_clock::now() >= held_since_ + hold_for()) held_ = 0;
          }
          engine_sleeping_ = false;
        }
        // A failure recorded by another thread (a waiter driving a round, the out-of-band lane)
        // has already been published to the peers, with its kind: nothing more to say here.
        if (stop_ || fatal_ != ErrorKind::kNone) break;
        driving_ = true;
      }
      if (tl) {
        const double t = timeline_.now();
        if (t - t_idle > 1.0) timeline_.span(Timeline::kEngineLane, "engine", "idle", t_idle, t);
      }
      const bool last = run_round();
      {
        std::lock_guard<std::mutex> lk(mu_);
        driving_ = false;
        comm_->set_engine_idle(queue_.empty());
      }
      done_cv_.notify_all();  // waiters whose requests are still queued may drive the next round
      if (last) break;
    }
  } catch (...) {
    fail_from_current();
  }
  std::lock_guard<std::mutex> lk(mu_);
  driving_ = false;
  stopped_ = true;
  done_cv_.notify_all();
}

void Engine::oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                           double postscale) {
  check_process();
  std::lock_guard<std::mutex> serial(oob_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (fatal_ != ErrorKind::kNone) throw_error(fatal_, fatal_msg_);
    if (stopped_ || shutdown_requested_) throw EngineError("fastxfer has been shut down; call init() again first");
  }
  // On failure, poison the group but leave the requests the engine thread is running to it:
  // failing them from here would let their waiters release buffers the thread still uses. The
  // abort makes the engine thread's next wait throw, and its own handler fails everything with
  // the error recorded here.
  auto poison = [&](ErrorKind kind, const char* what, bool mismatch) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (fatal_ == ErrorKind::kNone) {
        fatal_ = kind;
        fatal_msg_ = what;
      }
    }
    comm_->mark_exited(false, what, mismatch);
    comm_->abort();
    work_cv_.notify_all();
  };
  try {
    comm_->oob_allreduce(rec, in, out, n, dtype, op, postscale);
  } catch (const PeerFailure& e) {
    poison(ErrorKind::kPeerFailure, e.what(), false);
    throw;
  } catch (const Mismatch& e) {
    poison(ErrorKind::kMismatch, e.what(), true);
    throw;
  }
}

void Engine::shutdown() {
  bool healthy;
  {
    std::lock_guard<std::mutex> lk(mu_);
    healthy = fatal_ == ErrorKind::kNone && !stopped_ && !shutdown_requested_;
  }
  std::exception_ptr err;
  if (healthy) {
    try {
      Request r;
      r.kind = CollectiveKind::kShutdown;
      r.rec = make_record(CollectiveKind::kShutdown, "shutdown", DType::kFloat32, {}, ReduceOp::kSum,
                          Compression::kNone, 0, 1.0, 1.0);
      wait(submit(std::move(r)));
    } catch (...) {
      err = std::current_exception();
    }
  }
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    if (!healthy || err) comm_->abort();
    thread_.join();
  }
  // On failure the engine thread has already told the peers why; keep that message.
  if (fatal_ == ErrorKind::kNone && !err) comm_->mark_exited(true, "shut down");
  timeline_.close();
  fail_callbacks(ErrorKind::kEngine, "fastxfer was shut down before this collective ran");
  if (err) std::rethrow_exception(err);
}

std::shared_ptr<Engine> start_engine(const JobConfig& job, std::shared_ptr<InterHost> inter) {
  auto local = std::make_unique<ShmCollectives>(job.shm, job.threads, job.stream_min_bytes);
  std::unique_ptr<Engine> eng =
      inter ? std::make_unique<Engine>(std::make_unique<HierarchicalCollectives>(std::move(local), inter, job.net_chunk_bytes,
                                                                                   job.host_timeout_s, job.host_id,
                                                                                   job.host_leader),
                                       job.engine)
            : std::make_unique<Engine>(std::move(local), job.engine);
  // A forked child holds a copy of the parent's engine: its thread does not exist there, its
  // mutexes and condition variables may be mid-use (destroying one would wait forever for the
  // parent's waiters) and its shared memory is the parent's. So the child never destroys it: no
  // join, no abort, no "exited" mark that would fail the parent's peers. The memory is the
  // child's own copy and goes with it.
  const pid_t owner = getpid();
  return std::shared_ptr<Engine>(eng.release(), [owner](Engine* e) {
    if (getpid() == owner) delete e;
  });
}

}  // namespace fastxfer
