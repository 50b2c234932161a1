// Several hosts: shared memory among the ranks of each host, an InterHost link (MPI) between
// hosts. Each local rank owns one shard of every chunk and reduces it across hosts with its
// counterparts (the ranks with the same local rank), so all local ranks use the network at once.
#pragma once
#include <memory>

#include "collectives/shm_collectives.h"
#include "transport/inter_host.h"

namespace fastxfer {

class HierarchicalCollectives : public Collectives {
 public:
  HierarchicalCollectives(std::unique_ptr<ShmCollectives> local, std::shared_ptr<InterHost> inter);

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
};

}  // namespace fastxfer
