// Collectives among the ranks of one host through one POSIX shared-memory segment.
#pragma once
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "transport/shm/sync.h"
#include "transport/transport.h"

namespace fastxfer {

struct ShmConfig {
  std::string name;            // "/fastxfer-..." — unguessable, per job (from the launcher or MPI)
  int rank = 0;                // rank among the processes sharing this segment
  int size = 1;
  size_t window_bytes = 16u << 20;  // per-rank staging window (two halves, double-buffered)
  size_t oob_bytes = 1u << 20;      // per-rank out-of-band slot
  int max_records = 1024;           // requests agreed per negotiation round
  double timeout_s = 300;           // a peer that does not answer for this long is a failure
  double attach_timeout_s = 120;    // how long ranks wait for each other at start-up
  int threads = 1;                  // threads for pack/unpack inside one chunk
  size_t stream_min_bytes = 4u << 20;  // buckets whose outputs are this large use streaming stores
};

class ShmTransport : public Transport {
 public:
  // Rank 0 creates the segment (O_EXCL, mode 0600), the others open it; once all have attached,
  // rank 0 unlinks the name, so nothing is left in /dev/shm even if every rank is killed later.
  explicit ShmTransport(const ShmConfig& cfg);
  ~ShmTransport() override;

  int rank() const override { return cfg_.rank; }
  int size() const override { return cfg_.size; }
  std::vector<std::vector<Record>> exchange_records(const std::vector<Record>& mine) override;
  void allreduce(const AllreduceJob& job) override { allreduce_staged(job, nullptr); }
  // For the hierarchical transport: after the shard a rank owns is reduced within the host (and
  // before anyone copies it), `between(shard, n, wire)` runs on it; postscale is then its job.
  using ShardHook = std::function<void(char* shard, size_t n, DType wire)>;
  void allreduce_staged(const AllreduceJob& job, const ShardHook& between);
  void broadcast(const void* in, void* out, size_t nbytes, int root) override;
  void allgather(const void* in, void* out, const std::vector<size_t>& bytes) override;
  void oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                     double postscale) override;
  void mark_exited(bool clean, const char* why) override;
  size_t oob_capacity() const override { return cfg_.oob_bytes - sizeof(Record); }
  void abort() override { aborted_.store(true); }
  TransportStats stats() const override { return stats_; }
  int max_records() const { return cfg_.max_records; }

 private:
  struct Header;
  struct Control;

  void attach(bool creator, double deadline);  // the constructor's part after mmap
  Control& ctl(int j) const;
  char* window(int j, int half) const;
  char* oob(int j) const;
  Record* records(int j, int buf) const;
  uint32_t* record_count(int j, int buf) const;

  // Blocks until counter `which` of every rank in [0, size) has reached `target`.
  void wait_all(shm::Counter Control::*which, uint32_t target, const char* phase);
  void wait_one(int j, shm::Counter Control::*which, uint32_t target, const char* phase);
  void check_peers(int waiting_for, const char* phase, double waited_s);

  ShmConfig cfg_;
  int fd_ = -1;
  void* base_ = nullptr;
  size_t total_ = 0;
  size_t stride_ = 0, ctl_off_ = 0, rec_off_ = 0, oob_off_ = 0, win_off_ = 0, header_bytes_ = 0;
  // Sequence numbers, the same on every rank. 64-bit here so "is this the first use" tests never
  // wrap; the shared counters carry the low 32 bits (compared with serial arithmetic).
  uint64_t chunk_ = 0;    // data chunks done
  uint64_t round_ = 0;    // negotiation rounds done
  uint64_t oob_seq_ = 0;  // out-of-band reductions done
  std::atomic<bool> aborted_{false};
  TransportStats stats_;
};

}  // namespace fastxfer
