// Hierarchical collectives: local rounds and chunks in shared memory, global agreement and the
// cross-host leg of every shard through InterHost.
#include "collectives/hierarchical.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "common/errors.h"
#include "fusion/pack.h"
#include "kernels/reduce.h"

namespace fastxfer {

namespace {

// Hash of what ranks must agree on: compare_records' fields. allgather's and alltoall's first
// dimension and element count may differ per rank, so they are left out. Running: out[i] covers
// the first i records (out[0]: none), so ranks with lists of different lengths can compare any
// common prefix.
std::vector<uint64_t> running_digests(const std::vector<Record>& recs, size_t m) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  };
  std::vector<uint64_t> out{h};
  for (size_t i = 0; i < m; ++i) {
    const Record& r = recs[i];
    mix(&r.name_hash, sizeof r.name_hash);
    mix(&r.kind, sizeof r.kind);
    mix(&r.dtype, sizeof r.dtype);
    mix(&r.op, sizeof r.op);
    mix(&r.compression, sizeof r.compression);
    mix(&r.root, sizeof r.root);
    mix(&r.ndim, sizeof r.ndim);
    mix(&r.shape_hash, sizeof r.shape_hash);
    mix(&r.prescale, sizeof r.prescale);
    mix(&r.postscale, sizeof r.postscale);
    mix(&r.bucket_cap, sizeof r.bucket_cap);
    if (!first_dim_may_differ(static_cast<CollectiveKind>(r.kind))) mix(&r.numel, sizeof r.numel);
    out.push_back(h);
  }
  return out;
}

}  // namespace

NetLane::NetLane() : s_(std::make_shared<State>()) {
  std::shared_ptr<State> s = s_;  // the thread keeps the state alive if it must be detached
  thread_ = std::thread([s] {
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
      s->cv.wait(lk, [&] { return s->stop || !s->todo.empty(); });
      if (s->todo.empty()) return;  // stopped, nothing left
      std::function<void()> job = std::move(s->todo.front());
      s->todo.pop_front();
      s->busy = true;
      lk.unlock();
      std::exception_ptr err;
      try {
        job();
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      s->busy = false;
      s->done.push_back(err);
      s->cv.notify_all();
    }
  });
}

NetLane::~NetLane() {
  bool idle;
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->stop = true;
    s_->todo.clear();  // not started: never will be
    idle = !s_->busy;
  }
  s_->cv.notify_all();
  // A job still running (a step that failed half-way, its network call stuck on a lost host)
  // may need the interpreter lock the destroying thread may hold: leave it to finish alone.
  if (idle) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

void NetLane::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->todo.push_back(std::move(job));
  }
  s_->cv.notify_all();
}

void NetLane::wait() {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->cv.wait(lk, [&] { return !s_->done.empty() || s_->interrupted; });
  if (s_->interrupted) throw PeerFailure(s_->why);
  std::exception_ptr err = s_->done.front();
  s_->done.pop_front();
  if (err) std::rethrow_exception(err);
}

bool NetLane::wait_for(double seconds) {
  std::unique_lock<std::mutex> lk(s_->mu);
  auto ready = [&] { return !s_->done.empty() || s_->interrupted; };
  if (!s_->cv.wait_for(lk, std::chrono::duration<double>(seconds), ready) || s_->interrupted) return false;
  s_->done.pop_front();  // its error, if any, is dropped
  return true;
}

void NetLane::interrupt(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    if (s_->interrupted) return;
    s_->interrupted = true;
    s_->why = why;
  }
  s_->cv.notify_all();
}

bool NetLane::busy() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->busy || !s_->todo.empty();
}

HierarchicalCollectives::HierarchicalCollectives(std::unique_ptr<ShmCollectives> local, std::shared_ptr<InterHost> inter,
                                                 size_t net_chunk_bytes, double host_timeout_s,
                                                 const std::string& host_id, bool leader)
    : local_(std::move(local)), leader_(leader), inter_(std::move(inter)), net_chunk_bytes_(net_chunk_bytes), host_id_(host_id),
      lane_(std::make_unique<NetLane>()) {
  // A network wait gives up when a rank of this host failed or died: it would otherwise last until
  // this rank's own heartbeats noticed the host that rank lost (the launcher may kill it first).
  inter_->set_local_watch([local = local_.get()] { local->check_peers_now("a network wait"); });
  if (host_timeout_s > 0) start_heartbeat(host_timeout_s);
}

HierarchicalCollectives::~HierarchicalCollectives() {
  inter_->set_local_watch(nullptr);  // it reads the shared memory: gone before the memory may be
  beat_.reset();  // its callback uses the lanes and the shared memory: stop it first
  // A network call still running is stuck on a lost host; if it ever returns it writes into this
  // rank's window (an allreduce shard), so the mapping must outlive it: leave it mapped (its name
  // was unlinked at attach; the memory goes with the process).
  const bool stuck = lane_->busy() || (oob_lane_ && oob_lane_->busy());
  lane_.reset();
  oob_lane_.reset();
  if (stuck) (void)local_.release();
}

namespace {

std::string host_label() {
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) != 0) std::strcpy(name, "?");
  return name;
}

}  // namespace

void HierarchicalCollectives::start_heartbeat(double timeout_s) {
  // Every rank tells every other how to reach it; its counterparts on the other hosts (the same
  // local rank) are the peers it watches. Rank 0's token marks this job's datagrams.
  beat_ = std::make_unique<HostHeartbeat>();
  const std::string machine = host_label();
  const std::string label = host_id_.empty() ? machine : machine + "/" + host_id_;  // emulated hosts
  std::random_device rd;
  const uint64_t token = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::ostringstream mine;
  mine << machine << '\n' << label << '\n' << local_->rank() << '\n' << token << '\n' << beat_->endpoint();
  const std::string m = mine.str();
  const auto all = inter_->allgather_bytes(std::vector<char>(m.begin(), m.end()));
  std::vector<HeartbeatPeer> peers;
  uint64_t job_token = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream s(std::string(all[r].begin(), all[r].end()));
    std::string their_machine, their_label, ep;
    int their_local = -1;
    uint64_t their_token = 0;
    std::getline(s, their_machine);
    std::getline(s, their_label);
    s >> their_local >> their_token;
    s.ignore(1);
    std::getline(s, ep);
    if (r == 0) job_token = their_token;
    if (static_cast<int>(r) == inter_->rank() || their_local != local_->rank()) continue;
    HeartbeatPeer p;
    p.rank = static_cast<int>(r);
    p.host = their_label;
    p.addrs = HostHeartbeat::parse_endpoint(ep, their_machine == machine);
    peers.push_back(std::move(p));
  }
  const double interval = std::min(1.0, std::max(0.05, timeout_s / 10));
  beat_->start(inter_->rank(), job_token, std::move(peers), interval, timeout_s,
               [this](const std::string& why) { host_lost(why); });
}

void HierarchicalCollectives::host_lost(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(lost_mu_);
    if (lost_.load()) return;
    lost_why_ = why;
    lost_.store(true);
    inter_->interrupt(why);  // a network wait on the engine's thread fails now
    lane_->interrupt(why);   // and one on a lane
    if (oob_lane_) oob_lane_->interrupt(why);
  }
  local_->abort();  // and one waiting for a local peer (stuck on its own network call)
}

void HierarchicalCollectives::on_lane(std::function<void()> f) {
  // Nothing would interrupt the wait, or the link's own waits can be interrupted: spare the
  // thread hand-off (~0.3 ms a round).
  if (!beat_ || inter_->interruptible()) {
    f();
    return;
  }
  lane_->post(std::move(f));
  lane_->wait();
}

template <class F>
void HierarchicalCollectives::guarded(F&& body) {
  try {
    if (lost_.load()) throw PeerFailure("");
    body();
  } catch (...) {
    if (!lost_.load()) throw;
    std::lock_guard<std::mutex> lk(lost_mu_);
    throw PeerFailure(lost_why_);
  }
}

void HierarchicalCollectives::exchange_records(const std::vector<Record>& mine, std::vector<std::vector<Record>>& all) {
  guarded([&] { all = exchange(mine); });
}

std::vector<std::vector<Record>> HierarchicalCollectives::exchange(const std::vector<Record>& mine) {
  // (over every rank: the records themselves when something disagrees, and allgather's sizes)
  auto gather = [&](std::vector<char> bytes) { return gather_on_lane(std::move(bytes), false); };
  auto gather_all = [&](const std::vector<Record>& recs) {
    std::vector<char> bytes(recs.size() * sizeof(Record));
    std::memcpy(bytes.data(), recs.data(), bytes.size());
    std::vector<std::vector<Record>> all;
    for (const auto& b : gather(std::move(bytes))) {
      std::vector<Record> l(b.size() / sizeof(Record));
      std::memcpy(l.data(), b.data(), l.size() * sizeof(Record));
      all.push_back(std::move(l));
    }
    return all;
  };
  eager_ = 0;
  eager_sum_ = nullptr;
  // 1. Within the host, as usual (with the data of the small allreduces offered).
  std::vector<std::vector<Record>>& local = local_records_;
  local_->exchange_records(mine, local);
  size_t m = mine.size();
  for (const auto& l : local) m = std::min(m, l.size());
  bool local_ok = true;
  for (size_t j = 1; j < local.size() && local_ok; ++j)
    for (size_t i = 0; i < m && local_ok; ++i)
      local_ok = compare_records(local[0][i], 0, local[j][i], static_cast<int>(j)).empty();
  // 2. Across hosts, by the host's first rank only when the host has several (`leader_`; with one
  //    rank per host every rank is its host's first): after step 1 every rank of a host knows the
  //    same things, so what one says for its host each of the others would say too. It tells them
  //    the verdict through shared memory (crossing hosts from every rank at once costs more, with
  //    the host's cores shared: docs/algorithms.md, "One rank per host"). Without `leader_`
  //    every rank exchanges with its counterparts (the same local rank) on every host.
  Verdict v;
  const bool lead = leader_ && local_->size() > 1;
  if (lead && local_->rank() != 0) {
    const char* area = local_->wait_verdict();
    std::memcpy(&v, area, sizeof v);
  } else {
    char* area = lead ? local_->verdict_area() : nullptr;
    v = cross(mine, local_ok, m, area ? area + kVerdictHead : nullptr);
    if (area) {
      std::memcpy(area, &v, sizeof v);
      local_->publish_verdict();
    }
  }
  if (v.status != Verdict::kDisagree && (v.agreed < 0 || static_cast<size_t>(v.agreed) > mine.size() || v.eager > v.agreed ||
                                   v.sum_bytes < 0 || static_cast<size_t>(v.sum_bytes) > kEagerSlotBytes))
    throw EngineError("agreement round across hosts: the host's first rank sent a verdict this rank cannot use (" +
                      std::to_string(v.agreed) + " of " + std::to_string(mine.size()) + " requests)");
  if (v.status == Verdict::kDisagree) return gather_all(mine);
  const size_t a = static_cast<size_t>(v.agreed);
  std::vector<Record> prefix(mine.begin(), mine.begin() + a);
  if (v.status == Verdict::kDigests) return gather_all(prefix);
  // 3. Identical everywhere. An allgather takes every rank's own sizes: for a round that has one,
  //    each rank's element count and first dimension of each record, from every rank.
  const size_t n = static_cast<size_t>(inter_->size());
  std::vector<std::vector<Record>> all(n, prefix);
  bool sizes = false;
  for (const Record& r : prefix) sizes = sizes || static_cast<CollectiveKind>(r.kind) == CollectiveKind::kAllgather;
  if (sizes) {
    std::vector<int64_t> words(2 * a);
    for (size_t i = 0; i < a; ++i) {
      words[2 * i] = prefix[i].numel;
      words[2 * i + 1] = prefix[i].ndim > 0 ? prefix[i].shape[0] : 1;
    }
    std::vector<char> bytes(words.size() * sizeof(int64_t));
    std::memcpy(bytes.data(), words.data(), bytes.size());
    const std::vector<std::vector<char>> each = gather(std::move(bytes));
    for (size_t j = 0; j < n; ++j) {
      if (each[j].size() != 2 * a * sizeof(int64_t)) throw EngineError("agreement round across hosts: rank " +
                                                                       std::to_string(j) + " sent sizes of another round");
      std::memcpy(words.data(), each[j].data(), each[j].size());
      for (size_t i = 0; i < a; ++i) {
        if (static_cast<CollectiveKind>(prefix[i].kind) != CollectiveKind::kAllgather) continue;
        all[j][i].numel = words[2 * i];
        if (all[j][i].ndim > 0) all[j][i].shape[0] = words[2 * i + 1];
      }
    }
  }
  if (v.eager > 0) {
    eager_ = static_cast<uint32_t>(v.eager);
    eager_sum_ = lead ? local_->verdict_area() + kVerdictHead : eager_own_.data();
  }
  return all;
}

std::vector<std::vector<char>> HierarchicalCollectives::gather_on_lane(std::vector<char> bytes, bool across) {
  // On the lane, on buffers the job owns (a job left running must not write here).
  auto inter = inter_;
  auto box = std::make_shared<std::vector<std::vector<char>>>();
  on_lane([inter, box, across, bytes = std::move(bytes)] {
    *box = across ? inter->allgather_bytes_across(bytes) : inter->allgather_bytes(bytes);
  });
  return std::move(*box);
}

HierarchicalCollectives::Verdict HierarchicalCollectives::cross(const std::vector<Record>& mine, bool local_ok, size_t m,
                                                                char* sum_out) {
  // The message: the host's count (-1: it disagrees inside), the running digest after each of its
  // first `count` records, then the one-exchange path's share: how many requests the host's partial
  // result covers and that partial (reduced over the host's ranks in rank order, unscaled, in the
  // wire dtype). The agreed prefix is the shortest count anywhere; it runs if every host's digest
  // of it is the same. Every rank reaches the same verdict from the same messages; a disagreement
  // anywhere becomes a MismatchError everywhere (with global rank numbers, from an allgather of the
  // records themselves over every rank).
  const size_t k = local_ok ? m : 0;
  const std::vector<uint64_t> dig = running_digests(mine, k);
  const int64_t host_eager = local_ok && offered_.numel > 0 ? std::min<int64_t>(local_->eager_agreed(), k) : 0;
  const size_t partial_numel = host_eager > 0 ? eager_numel(offered_, static_cast<size_t>(host_eager)) : 0;
  const size_t partial_bytes = partial_numel * dtype_size(offered_.wire_dtype);
  const int64_t head[3] = {local_ok ? static_cast<int64_t>(m) : -1, host_eager, static_cast<int64_t>(partial_bytes)};
  std::vector<char> payload(sizeof head + k * sizeof(uint64_t) + partial_bytes);
  std::memcpy(payload.data(), head, sizeof head);
  if (k > 0) std::memcpy(payload.data() + sizeof head, &dig[1], k * sizeof(uint64_t));
  if (partial_bytes > 0)
    local_->eager_partial(offered_, partial_numel, offered_op_, payload.data() + sizeof head + k * sizeof(uint64_t));
  const std::vector<std::vector<char>> got = gather_on_lane(std::move(payload), true);
  const size_t hosts = got.size();
  Verdict v;
  int64_t agreed = std::numeric_limits<int64_t>::max(), eager = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> count(hosts);
  for (size_t h = 0; h < hosts; ++h) {
    int64_t their[3] = {-1, -1, -1};
    if (got[h].size() >= sizeof their) std::memcpy(their, got[h].data(), sizeof their);
    count[h] = their[0];
    if (their[0] < 0 || their[1] < 0 || their[2] < 0 ||
        got[h].size() != sizeof their + static_cast<size_t>(their[0]) * sizeof(uint64_t) + static_cast<size_t>(their[2])) {
      v.status = Verdict::kDisagree;
      return v;
    }
    agreed = std::min(agreed, their[0]);
    eager = std::min(eager, their[1]);
  }
  const size_t a = static_cast<size_t>(agreed);
  v.agreed = agreed;
  auto digest_of = [&](size_t h) {
    if (a == 0) return dig[0];
    uint64_t d;
    std::memcpy(&d, got[h].data() + 3 * sizeof(int64_t) + (a - 1) * sizeof(uint64_t), sizeof d);
    return d;
  };
  for (size_t h = 1; h < hosts; ++h)
    if (digest_of(h) != digest_of(0)) {
      v.status = Verdict::kDigests;
      return v;
    }
  if (eager > 0) {
    // Every host's partial covers at least `eager` requests, laid out alike (the same records in
    // the same order): add them in host order, unscaled (eager_allreduce scales once, as the
    // chunk path does: the same bits either way).
    v.eager = std::min(eager, agreed);
    const size_t numel = eager_numel(offered_, static_cast<size_t>(v.eager));
    std::vector<const void*> srcs;
    for (size_t h = 0; h < hosts; ++h)
      srcs.push_back(got[h].data() + 3 * sizeof(int64_t) + static_cast<size_t>(count[h]) * sizeof(uint64_t));
    const size_t bytes = numel * dtype_size(offered_.wire_dtype);
    if (bytes > kEagerSlotBytes) throw std::logic_error("an eager sum larger than its slot");
    v.sum_bytes = static_cast<int64_t>(bytes);
    if (!sum_out) {
      eager_own_.resize(bytes);
      sum_out = eager_own_.data();
    }
    reduce_block(offered_op_, offered_.wire_dtype, srcs.data(), static_cast<int>(srcs.size()), sum_out, numel, 1.0);
  }
  return v;
}

size_t HierarchicalCollectives::eager_numel(const Bucket& b, size_t count) {
  return count == 0 ? 0 : b.offsets[count - 1] + b.numels[count - 1];
}

void HierarchicalCollectives::eager_offer(const AllreduceJob* job, uint32_t count) {
  local_->eager_offer(job, count);
  offered_ = count > 0 ? *job->bucket : Bucket{};
  offered_op_ = count > 0 ? job->op : ReduceOp::kSum;
}

void HierarchicalCollectives::eager_allreduce(const AllreduceJob& job) {
  const Bucket& b = *job.bucket;
  if (!eager_sum_) throw std::logic_error("no sum across hosts for the one-exchange path");
  thread_local std::vector<char> scratch;
  const bool direct = b.tensors.size() == 1 && b.wire_dtype == b.dtype;
  if (!direct) scratch.resize(b.nbytes());
  void* dst = direct ? job.outs[0] : scratch.data();
  // The sum over hosts (a prefix of it: this bucket may cover fewer requests), scaled once.
  const void* src = eager_sum_;
  reduce_block(job.op, b.wire_dtype, &src, 1, dst, b.numel, job.postscale);
  if (!direct) unpack(b, scratch.data(), job.outs, 1.0, 1);
  local_->count_eager(b.nbytes());
}

void HierarchicalCollectives::allreduce(const AllreduceJob& job) {
  guarded([&] { allreduce_impl(job); });
}

void HierarchicalCollectives::allreduce_impl(const AllreduceJob& job) {
  // Reduce each shard within the host (unscaled), across hosts, then scale once.
  // (the lane's copy holds the link: a job left running when this object goes keeps it alive)
  auto across = [inter = inter_, op = job.op, scale = job.postscale](char* shard, size_t n, DType wire) {
    inter->allreduce_shard(shard, n, wire, op);
    if (scale != 1.0) {
      const void* src = shard;
      reduce_block(op, wire, &src, 1, shard, n, scale);
    }
  };
  // The shards live in this rank's window, which outlives any job left running (see the
  // destructor), so one abandoned on failure writes nowhere it should not.
  // A bucket that fits one network chunk has nothing to overlap: handing its one shard to the lane
  // would only add a thread hand-off (0.1 ms measured on 2x2 simulated hosts at 4-64 KiB).
  if (net_chunk_bytes_ == 0 || job.bucket->nbytes() <= net_chunk_bytes_) {
    local_->allreduce_with_hook(job, [&](char* shard, size_t n, DType wire) {
      on_lane([across, shard, n, wire] { across(shard, n, wire); });
    });
    return;
  }
  // Every shard posted is waited for before this returns normally.
  size_t in_flight = 0;
  ShardPipeline pipe;
  pipe.max_chunk_bytes = net_chunk_bytes_;
  pipe.start = [&](char* shard, size_t n, DType wire) {
    lane_->post([across, shard, n, wire] { across(shard, n, wire); });
    ++in_flight;
  };
  pipe.finish = [&] {
    --in_flight;
    lane_->wait();
  };
  try {
    local_->allreduce_pipelined(job, pipe);
  } catch (...) {
    // The group is failing. Give the shard still on the network a few seconds to end (its peers
    // fail the same way); its own error is a consequence, not the cause. One stuck on a lost
    // host is left running: the engine is going down, and a hang here would hide the error.
    for (; in_flight > 0; --in_flight)
      if (!lane_->wait_for(5.0)) break;
    throw;
  }
}

// Broadcast, allgather and alltoall go through buffers the lane's job owns: on a lost host the
// caller gets PeerFailure while the MPI call may still be running, and the caller's buffers may be
// freed at once. The copies cost little next to the network.
void HierarchicalCollectives::broadcast(const void* in, void* out, size_t nbytes, int root) {
  guarded([&] {
    auto buf = std::make_shared<std::vector<char>>(nbytes);
    if (inter_->rank() == root && nbytes > 0) std::memcpy(buf->data(), in, nbytes);
    on_lane([inter = inter_, buf, root] { inter->broadcast(buf->data(), buf->size(), root); });
    if (nbytes > 0) std::memcpy(out, buf->data(), nbytes);
  });
}

void HierarchicalCollectives::allgather(const void* in, void* out, const std::vector<size_t>& bytes) {
  guarded([&] {
    size_t total = 0;
    for (size_t b : bytes) total += b;
    const size_t mine = bytes.at(static_cast<size_t>(inter_->rank()));
    auto src = std::make_shared<std::vector<char>>(static_cast<const char*>(in), static_cast<const char*>(in) + mine);
    auto dst = std::make_shared<std::vector<char>>(total);
    on_lane([inter = inter_, src, dst, bytes] { inter->allgatherv(src->data(), dst->data(), bytes); });
    if (total > 0) std::memcpy(out, dst->data(), total);
  });
}

void HierarchicalCollectives::alltoall(const void* in, void* out, const std::vector<size_t>& bytes) {
  // Straight over MPI's Alltoallv among all ranks (MPI moves the pairs on one host through its own
  // shared memory): the blocks differ per pair, so there is no shard to share within the host.
  guarded([&] {
    const size_t n = static_cast<size_t>(inter_->size()), me = static_cast<size_t>(inter_->rank());
    std::vector<size_t> send(n), recv(n);
    size_t sent = 0, received = 0;
    for (size_t j = 0; j < n; ++j) {
      send[j] = bytes[me * n + j];
      recv[j] = bytes[j * n + me];
      sent += send[j];
      received += recv[j];
    }
    auto src = std::make_shared<std::vector<char>>(static_cast<const char*>(in), static_cast<const char*>(in) + sent);
    auto dst = std::make_shared<std::vector<char>>(received);
    on_lane([inter = inter_, src, dst, send = std::move(send), recv = std::move(recv)] {
      inter->alltoallv(src->data(), dst->data(), send, recv);
    });
    if (received > 0) std::memcpy(out, dst->data(), received);
  });
}

void HierarchicalCollectives::reducescatter(const ReducescatterJob& job) {
  // The whole tensor goes through the hierarchical allreduce (every rank gets every row), then each
  // rank keeps its rows: correct, but it moves the allgather half that a native reduce-scatter
  // across hosts would not (docs/algorithms.md).
  guarded([&] {
    size_t total = 0;
    for (size_t c : job.counts) total += c;
    const size_t es = dtype_size(job.dtype);
    std::vector<char> tmp(std::max<size_t>(total * es, 1));
    if (total > 0) {
      BucketPlanner planner(std::max<size_t>(total * es, 64), std::max<size_t>(total * es, 64), Compression::kNone);
      const std::vector<Bucket> buckets = planner.plan({{total, job.dtype}});
      AllreduceJob aj{&buckets.at(0), {job.in}, {tmp.data()}, job.op, 1.0, job.scale};
      allreduce_impl(aj);
    }
    size_t start = 0;
    for (int j = 0; j < inter_->rank(); ++j) start += job.counts[j];
    const size_t mine = job.counts[inter_->rank()];
    if (mine > 0) std::memcpy(job.out, tmp.data() + start * es, mine * es);
  });
}

void HierarchicalCollectives::oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype,
                                          ReduceOp op, double postscale) {
  // On the caller's thread (the engine's oob lock held), through a lane of its own so that a lost
  // host interrupts it too.
  guarded([&] {
    const size_t bytes = n * dtype_size(dtype);
    auto src = std::make_shared<std::vector<char>>(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    auto dst = std::make_shared<std::vector<char>>(bytes);
    {
      std::lock_guard<std::mutex> lk(lost_mu_);  // host_lost() interrupts what exists
      if (!oob_lane_) oob_lane_ = std::make_unique<NetLane>();
    }
    if (lost_.load()) throw PeerFailure("");
    oob_lane_->post([inter = inter_, src, dst, n, dtype, op, what = describe(rec)] {
      inter->oob_allreduce(src->data(), dst->data(), n, dtype, op, what);
    });
    oob_lane_->wait();
    if (bytes > 0) std::memcpy(out, dst->data(), bytes);
    if (postscale != 1.0) {
      const void* p = out;
      reduce_block(op, dtype, &p, 1, out, n, postscale);
    }
  });
}

}  // namespace fastxfer
