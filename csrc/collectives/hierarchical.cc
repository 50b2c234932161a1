// Hierarchical collectives: local rounds and chunks in shared memory, global agreement and the
// cross-host leg of every shard through InterHost.
#include "collectives/hierarchical.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "kernels/reduce.h"

namespace fastxfer {

namespace {

// Hash of what ranks must agree on: compare_records' fields. allgather's and alltoall's first
// dimension and element count may differ per rank, so they are left out.
uint64_t digest(const std::vector<Record>& recs, size_t m) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  };
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
  }
  return h;
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
  s_->cv.wait(lk, [&] { return !s_->done.empty(); });
  std::exception_ptr err = s_->done.front();
  s_->done.pop_front();
  if (err) std::rethrow_exception(err);
}

bool NetLane::wait_for(double seconds) {
  std::unique_lock<std::mutex> lk(s_->mu);
  if (!s_->cv.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return !s_->done.empty(); })) return false;
  s_->done.pop_front();  // its error, if any, is dropped
  return true;
}

HierarchicalCollectives::HierarchicalCollectives(std::unique_ptr<ShmCollectives> local, std::shared_ptr<InterHost> inter,
                                                 size_t net_chunk_bytes)
    : local_(std::move(local)), inter_(std::move(inter)), net_chunk_bytes_(net_chunk_bytes) {}

std::vector<std::vector<Record>> HierarchicalCollectives::exchange_records(const std::vector<Record>& mine) {
  auto gather_all = [&](const std::vector<Record>& recs) {
    std::vector<char> bytes(recs.size() * sizeof(Record));
    std::memcpy(bytes.data(), recs.data(), bytes.size());
    std::vector<std::vector<Record>> all;
    for (const auto& b : inter_->allgather_bytes(bytes)) {
      std::vector<Record> l(b.size() / sizeof(Record));
      std::memcpy(l.data(), b.data(), l.size() * sizeof(Record));
      all.push_back(std::move(l));
    }
    return all;
  };
  // 1. Within the host, as usual.
  auto local = local_->exchange_records(mine);
  size_t m = mine.size();
  for (const auto& l : local) m = std::min(m, l.size());
  bool local_ok = true;
  for (size_t j = 1; j < local.size() && local_ok; ++j)
    for (size_t i = 0; i < m && local_ok; ++i)
      local_ok = compare_records(local[0][i], 0, local[j][i], static_cast<int>(j)).empty();
  // 2. Across hosts: the shortest agreed prefix anywhere (-1: some host disagrees inside), then
  //    whether everyone's prefix is the same. Every rank takes part in every step, so a
  //    disagreement anywhere becomes a MismatchError everywhere (with global rank numbers).
  const int64_t agreed = inter_->min_all(local_ok ? static_cast<int64_t>(m) : -1);
  if (agreed < 0) return gather_all(mine);
  std::vector<Record> prefix(mine.begin(), mine.begin() + agreed);
  const std::vector<uint64_t> digests = inter_->allgather_u64(digest(mine, static_cast<size_t>(agreed)));
  for (uint64_t d : digests)
    if (d != digests[0]) return gather_all(prefix);
  // 3. Identical everywhere. allgather needs every rank's size: fetch those few numbers.
  std::vector<size_t> gathers;
  for (size_t i = 0; i < prefix.size(); ++i)
    if (static_cast<CollectiveKind>(prefix[i].kind) == CollectiveKind::kAllgather) gathers.push_back(i);
  std::vector<std::vector<Record>> all(inter_->size(), prefix);
  if (!gathers.empty()) {
    std::vector<char> mine_sizes(gathers.size() * 2 * sizeof(int64_t));
    for (size_t k = 0; k < gathers.size(); ++k) {
      int64_t v[2] = {prefix[gathers[k]].numel, prefix[gathers[k]].ndim > 0 ? prefix[gathers[k]].shape[0] : 1};
      std::memcpy(mine_sizes.data() + k * sizeof v, v, sizeof v);
    }
    auto sizes = inter_->allgather_bytes(mine_sizes);
    for (size_t j = 0; j < sizes.size(); ++j)
      for (size_t k = 0; k < gathers.size(); ++k) {
        int64_t v[2];
        std::memcpy(v, sizes[j].data() + k * sizeof v, sizeof v);
        all[j][gathers[k]].numel = v[0];
        if (all[j][gathers[k]].ndim > 0) all[j][gathers[k]].shape[0] = v[1];
      }
  }
  return all;
}

void HierarchicalCollectives::allreduce(const AllreduceJob& job) {
  // Reduce each shard within the host (unscaled), across hosts, then scale once.
  // (the lane's copy holds the link: a job left running when this object goes keeps it alive)
  auto across = [inter = inter_, op = job.op, scale = job.postscale](char* shard, size_t n, DType wire) {
    inter->allreduce_shard(shard, n, wire, op);
    if (scale != 1.0) {
      const void* src = shard;
      reduce_block(op, wire, &src, 1, shard, n, scale);
    }
  };
  if (net_chunk_bytes_ == 0) {
    local_->allreduce_with_hook(job, across);
    return;
  }
  if (!lane_) lane_ = std::make_unique<NetLane>();
  // Every shard posted is waited for before this returns normally. The shard lives in this
  // rank's window, which outlives this call, so one abandoned on failure (below) writes nowhere
  // it should not.
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

void HierarchicalCollectives::broadcast(const void* in, void* out, size_t nbytes, int root) {
  if (inter_->rank() == root && out != in) std::memcpy(out, in, nbytes);
  inter_->broadcast(out, nbytes, root);
}

void HierarchicalCollectives::allgather(const void* in, void* out, const std::vector<size_t>& bytes) {
  inter_->allgatherv(in, out, bytes);
}

void HierarchicalCollectives::alltoall(const void* in, void* out, const std::vector<size_t>& bytes) {
  // Straight over MPI's Alltoallv among all ranks (MPI moves the pairs on one host through its own
  // shared memory): the blocks differ per pair, so there is no shard to share within the host.
  const size_t n = static_cast<size_t>(inter_->size()), me = static_cast<size_t>(inter_->rank());
  std::vector<size_t> send(n), recv(n);
  for (size_t j = 0; j < n; ++j) {
    send[j] = bytes[me * n + j];
    recv[j] = bytes[j * n + me];
  }
  inter_->alltoallv(in, out, send, recv);
}

void HierarchicalCollectives::reducescatter(const ReducescatterJob& job) {
  // The whole tensor goes through the hierarchical allreduce (every rank gets every row), then each
  // rank keeps its rows: correct, but it moves the allgather half that a native reduce-scatter
  // across hosts would not (docs/algorithms.md).
  size_t total = 0;
  for (size_t c : job.counts) total += c;
  const size_t es = dtype_size(job.dtype);
  std::vector<char> tmp(std::max<size_t>(total * es, 1));
  if (total > 0) {
    BucketPlanner planner(std::max<size_t>(total * es, 64), std::max<size_t>(total * es, 64), Compression::kNone);
    const std::vector<Bucket> buckets = planner.plan({{total, job.dtype}});
    AllreduceJob aj{&buckets.at(0), {job.in}, {tmp.data()}, job.op, 1.0, job.scale};
    allreduce(aj);
  }
  size_t start = 0;
  for (int j = 0; j < inter_->rank(); ++j) start += job.counts[j];
  const size_t mine = job.counts[inter_->rank()];
  if (mine > 0) std::memcpy(job.out, tmp.data() + start * es, mine * es);
}

void HierarchicalCollectives::oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype,
                                          ReduceOp op, double postscale) {
  inter_->oob_allreduce(in, out, n, dtype, op, describe(rec));
  if (postscale != 1.0) {
    const void* src = out;
    reduce_block(op, dtype, &src, 1, out, n, postscale);
  }
}

}  // namespace fastxfer
