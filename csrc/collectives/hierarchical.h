// Several hosts: shared memory among the ranks of each host, an InterHost link (MPI) between
// hosts. Each local rank owns one shard of every chunk and reduces it across hosts with its
// counterparts (the ranks with the same local rank), so all local ranks use the network at once.
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "collectives/shm_collectives.h"
#include "transport/inter_host.h"

namespace fastxfer {

// A thread of its own for the cross-host stage, so that it overlaps the shared-memory stages
// (shm_allreduce_pipelined): jobs run one at a time, in order; wait() waits for the oldest and
// rethrows what it threw.
class NetLane {
 public:
  NetLane();
  ~NetLane();
  void post(std::function<void()> job);
  void wait();
  // As wait(), but drops the job's error; false (and the job left running) after `seconds`.
  bool wait_for(double seconds);

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> todo;
    std::deque<std::exception_ptr> done;  // one per finished job (null: it succeeded)
    bool stop = false, busy = false;
  };
  std::shared_ptr<State> s_;
  std::thread thread_;
};

class HierarchicalCollectives : public Collectives {
 public:
  // `net_chunk_bytes`: chunks of the allreduce hold at most this many bytes on the wire, so the
  // cross-host stage of one overlaps the shared-memory stages of the next (0: no overlap, one
  // cross-host call per half window, on the engine thread).
  HierarchicalCollectives(std::unique_ptr<ShmCollectives> local, std::shared_ptr<InterHost> inter,
                          size_t net_chunk_bytes = 1u << 20);

  int rank() const override { return inter_->rank(); }
  int size() const override { return inter_->size(); }
  std::vector<std::vector<Record>> exchange_records(const std::vector<Record>& mine) override;
  void allreduce(const AllreduceJob& job) override;
  void broadcast(const void* in, void* out, size_t nbytes, int root) override;
  void allgather(const void* in, void* out, const std::vector<size_t>& bytes) override;
  void alltoall(const void* in, void* out, const std::vector<size_t>& bytes) override;
  void reducescatter(const ReducescatterJob& job) override;
  void oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                     double postscale) override;
  void mark_exited(bool clean, const char* why, bool mismatch = false) override {
    local_->mark_exited(clean, why, mismatch);
  }
  void set_engine_idle(bool idle) override { local_->set_engine_idle(idle); }
  size_t oob_capacity() const override { return local_->oob_capacity(); }
  void abort() override { local_->abort(); }
  CommStats stats() const override { return local_->stats(); }

 private:
  std::unique_ptr<ShmCollectives> local_;
  std::shared_ptr<InterHost> inter_;
  size_t net_chunk_bytes_;
  std::unique_ptr<NetLane> lane_;  // started by the first pipelined allreduce
};

}  // namespace fastxfer
