// The link between hosts in C++: transport/inter_host.h on the MPI library that mpi4py has
// already loaded, called through its C API with no Python and no GIL on the engine's path.
//
// fastxfer is not compiled against any MPI: one wheel serves Open MPI, MPICH and Intel MPI. The
// functions are looked up (dlsym) in the library mpi4py loaded, and the two ABIs in use are told
// apart by the handles' representation: Open MPI's handles are pointers to its objects (MPI_BYTE
// is the address of `ompi_mpi_byte`), the MPICH family's (MPICH, Intel MPI, MVAPICH) are ints
// with constants fixed by its mpi.h. Only point-to-point calls on bytes are used
// (MPI_Isend/Irecv, MPI_Iprobe, MPI_Get_count, MPI_Testall, MPI_Cancel, MPI_Request_free,
// MPI_Error_string), so no MPI datatype or reduction op is needed: reductions use fastxfer's own
// kernels (kernels/reduce.h), in host order, so every host gets the same bits and 16-bit floats are
// rounded once (docs/architecture.md, "Across hosts").
//
// Waits poll (MPI_Testall, spinning for `spin_us`, then sleeping briefly) and give up with
// PeerFailure once interrupt() was called (a host lost: the heartbeats say so), so no thread is
// ever stuck inside MPI. mpi4py's communicators are passed in as handles; the Python object that
// owns them (fastxfer.comm.mpi.MPIInterHost) outlives this one.
#pragma once
#include <atomic>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/inter_host.h"

namespace fastxfer {

struct NativeMPIConfig {
  std::string library;      // a loaded object whose dependencies include libmpi (mpi4py's MPI module)
  std::string family;       // "openmpi" or "mpich" (MPICH, Intel MPI, MVAPICH: the MPICH ABI)
  uintptr_t world = 0;      // agreement rounds, broadcast, allgather, alltoall (every rank)
  uintptr_t cross = 0;      // this rank's counterparts, one per host (allreduce shards)
  uintptr_t oob = 0;        // oob_allreduce, from the caller's thread
  int rank = 0, size = 1;   // in `world`
  int cross_rank = 0, cross_size = 1;
  double spin_us = 50;      // how long a wait polls before it starts sleeping between polls
  size_t small_bytes = 64u << 10;  // allreduce shards that cost at most this to send to every other
                                   // host go in one round; others as a reduce-scatter + allgather
};

class NativeMPI;  // the C API, resolved once per process

class NativeMPIInterHost : public InterHost {
 public:
  // Throws EngineError naming what is missing (a function, an unknown family).
  explicit NativeMPIInterHost(const NativeMPIConfig& cfg);
  ~NativeMPIInterHost() override;

  int rank() const override { return cfg_.rank; }
  int size() const override { return cfg_.size; }
  void allreduce_shard(void* buf, size_t n, DType dtype, ReduceOp op) override;
  std::vector<std::vector<char>> allgather_bytes_across(const std::vector<char>& mine) override;
  std::vector<std::vector<char>> allgather_bytes(const std::vector<char>& mine) override;
  void broadcast(void* buf, size_t nbytes, int root) override;
  void allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override;
  void alltoallv(const void* in, void* out, const std::vector<size_t>& send_bytes,
                 const std::vector<size_t>& recv_bytes) override;
  void oob_allreduce(const void* in, void* out, size_t n, DType dtype, ReduceOp op,
                     const std::string& what) override;
  void interrupt(const std::string& why) override;
  bool interruptible() const override { return true; }
  void set_local_watch(std::function<void()> check) override;

 private:
  struct Op;  // one posted send or receive
  // Posts `ops` on `comm` and polls until all are done (or interrupt()).
  void run(uintptr_t comm, std::vector<Op>& ops, const char* what);
  std::vector<std::vector<char>> gather_any(uintptr_t comm, int me, int n, const std::vector<char>& mine, int tag,
                                            const char* what);
  void reduce_across(uintptr_t comm, int me, int n, void* buf, size_t count, DType dtype, ReduceOp op,
                     const char* what);

  NativeMPIConfig cfg_;
  // Runs the local watch when it is due (every kWatchS while a wait sleeps or yields).
  void watch(double waited, double& next);
  // Cancels and frees the first `n` requests of `reqs` (a call that gives up).
  void cancel(char* reqs, size_t n);
  // Between two polls of a wait begun at `start` on the `n` requests `reqs`: gives up (cancelling
  // them) when interrupted or when the local watch throws, else spins, yields or sleeps.
  void between_polls(double start, double& next_watch, long& sleep_ns, char* reqs, size_t n);
  std::shared_ptr<NativeMPI> mpi_;
  std::mutex watch_mu_;  // held while the watch runs: set_local_watch(nullptr) waits for it
  std::function<void()> watch_;
  std::atomic<bool> interrupted_{false};
  std::mutex why_mu_;
  std::string why_;
};

}  // namespace fastxfer
