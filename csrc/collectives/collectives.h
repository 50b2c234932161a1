// The interface the engine drives: agree on what comes next, then run the collectives. One
// implementation per topology: ShmCollectives (the ranks of one host, through a shared-memory
// segment) and HierarchicalCollectives (several hosts: shared memory inside, InterHost between).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/request.h"
#include "fusion/bucket_planner.h"

namespace fastxfer {

// One fused allreduce: the tensors of `bucket` (srcs[j] -> outs[j]), reduced with `op`.
// `prescale` multiplies the inputs while packing; `postscale` the reduced result before it is
// rounded to the wire dtype (1/size for an average).
struct AllreduceJob {
  const Bucket* bucket;
  std::vector<const void*> srcs;
  std::vector<void*> outs;
  ReduceOp op;
  double prescale;
  double postscale;
};

// One reducescatter: `in` holds the whole tensor (sum of counts elements of `dtype`); rank r's
// result is elements [counts[0] + ... + counts[r-1], ... + counts[r]) of the reduction, written
// to `out`. `scale` multiplies the reduced values (1/size for an average, times any post-scale
// factor; a pre-scale was applied to `in` already); integers truncate toward zero (kernels/reduce.h).
struct ReducescatterJob {
  const void* in;
  void* out;
  DType dtype;
  ReduceOp op;
  double scale;
  std::vector<size_t> counts;  // elements per rank, in rank order
};

// Where the collectives' time went, cumulative since start (seconds), for profiling.
struct CommStats {
  double pack = 0, wait = 0, reduce = 0, unpack = 0, negotiate = 0;
  uint64_t chunks = 0, rounds = 0, bytes = 0;
  uint64_t eager = 0;  // buckets that travelled with the records (the one-exchange path)
};

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Publishes this rank's records (the requests it has, in order, starting at the same global
  // index on every rank) and puts every rank's list in `all`, indexed by rank. `all` is the
  // caller's storage, kept from round to round: the lists reuse its capacity, so a round of a few
  // requests allocates nothing.
  virtual void exchange_records(const std::vector<Record>& mine, std::vector<std::vector<Record>>& all) = 0;

  // The one-exchange path for small allreduces (docs/algorithms.md, "Small allreduces"): the data
  // of the round's leading allreduces travels with the records, so such a bucket costs one wait
  // between ranks instead of the negotiation's and the chunk protocol's three.
  // The largest packed bucket it takes (0: no such path).
  virtual size_t eager_capacity() const { return 0; }
  // Before exchange_records: this rank's offer, the bucket of its first `count` requests (`job`
  // null when count is 0). Every rank offers in every round, if only 0.
  virtual void eager_offer(const AllreduceJob* job, uint32_t count) { (void)job, (void)count; }
  // After exchange_records: how many leading requests every rank's offer covered (the minimum).
  virtual uint32_t eager_agreed() const { return 0; }
  // Runs the bucket of the first n <= eager_agreed() requests (a prefix of the offered bucket,
  // which every rank laid out alike) from the data that came with the records.
  virtual void eager_allreduce(const AllreduceJob& job) { (void)job; }

  virtual void allreduce(const AllreduceJob& job) = 0;
  // `nbytes` on every rank; `in` is read on the root only; `out` written everywhere.
  virtual void broadcast(const void* in, void* out, size_t nbytes, int root) = 0;
  // Concatenates every rank's bytes in rank order into `out` (bytes[j] from rank j).
  virtual void allgather(const void* in, void* out, const std::vector<size_t>& bytes) = 0;

  // Every rank sends bytes[me * size + j] bytes to rank j, from `in` (blocks back to back in rank
  // order), and receives bytes[j * size + me] bytes from rank j into `out` (likewise). `bytes` is
  // the full size x size matrix, the same on every rank.
  virtual void alltoall(const void* in, void* out, const std::vector<size_t>& bytes) = 0;
  virtual void reducescatter(const ReducescatterJob& job) = 0;

  // Small, urgent reductions on a lane of their own (never behind a bucket): `in` -> `out`,
  // both `n` elements of `dtype`. Runs on the calling thread.
  virtual void oob_allreduce(const Record& rec, const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                             double postscale) = 0;

  // Tells the peers this rank is leaving: cleanly (after a shutdown) or with an error message,
  // so they fail fast instead of waiting for a timeout.
  // `mismatch`: the error was a disagreement between ranks; the peers raise it as one too.
  virtual void mark_exited(bool clean, const char* why, bool mismatch = false) = 0;
  // For `fastxfer run`: this rank fails because of rank `job_culprit` of the job, which `kind`
  // ("finished": it shut down while this rank still ran collectives); ShmSegment::report.
  virtual void report(int job_culprit, const std::string& kind, const std::string& msg) = 0;
  // The engine thread is about to wait for work with nothing queued (true), or has work (false).
  virtual void set_engine_idle(bool idle) = 0;

  // Largest message oob_allreduce accepts, in bytes.
  virtual size_t oob_capacity() const = 0;

  // Makes every wait in progress (and later) throw EngineError: used when the process tears the
  // engine down without a collective shutdown.
  virtual void abort() = 0;
  // A host of the job was lost (heartbeats across hosts): its network calls may still be running.
  virtual bool host_lost() const { return false; }

  virtual CommStats stats() const = 0;
};

}  // namespace fastxfer
