// The link between hosts: what the hierarchical collectives (collectives/hierarchical.cc) need from MPI (or any other
// inter-host engine). Buffers are this rank's; `n` elements of `dtype`; every call is collective
// over the ranks named in its comment, and all of them must call it in the same order.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/request.h"

namespace fastxfer {

class InterHost {
 public:
  virtual ~InterHost() = default;
  virtual int rank() const = 0;   // global rank
  virtual int size() const = 0;   // global size
  // In place, among the ranks with this rank's local rank on every host (one per host).
  // bf16/fp16 buffers hold wire values; sums round at each step (as NCCL's 16-bit allreduce does).
  virtual void allreduce_shard(void* buf, size_t n, DType dtype, ReduceOp op) = 0;
  // Among the same ranks (one per host), in host order: every one's bytes (the agreement round).
  virtual std::vector<std::vector<char>> allgather_bytes_across(const std::vector<char>& mine) = 0;
  // Over all ranks:
  virtual std::vector<std::vector<char>> allgather_bytes(const std::vector<char>& mine) = 0;
  virtual void broadcast(void* buf, size_t nbytes, int root) = 0;
  virtual void allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) = 0;
  // Rank r sends send_bytes[j] bytes to rank j (blocks of `in` back to back in rank order) and
  // receives recv_bytes[j] bytes from rank j into `out` (likewise).
  virtual void alltoallv(const void* in, void* out, const std::vector<size_t>& send_bytes,
                         const std::vector<size_t>& recv_bytes) = 0;
  // On a separate communicator, from the calling (not the engine) thread. `what` describes the
  // request (name, dtype, shape, op): ranks whose descriptions differ raise MismatchError.
  virtual void oob_allreduce(const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                             const std::string& what) = 0;
  // A host was lost: every wait in progress or to come gives up with PeerFailure(why). A link whose
  // waits can be interrupted so (interruptible()) is called on the engine's own thread; any other
  // runs on a thread of its own that the engine can abandon (collectives/hierarchical.h, NetLane).
  virtual void interrupt(const std::string& why) { (void)why; }
  virtual bool interruptible() const { return false; }
  // A check a long network wait runs now and then (every millisecond once it sleeps); it throws to
  // give up (a rank of this host failed: collectives/hierarchical.cc). Empty: none.
  virtual void set_local_watch(std::function<void()> check) { (void)check; }
};

}  // namespace fastxfer
