// A small persistent thread pool for splitting one memory-bound kernel call across cores.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "common/function_ref.h"

namespace fastxfer {

// Threads used when the caller passes threads <= 0: the count given to set_default_threads, else
// the number of CPUs in this process's affinity mask (so a numactl-bound worker does not
// oversubscribe).
int default_threads();
// Sets default_threads() for the whole process; n <= 0 goes back to the affinity mask's CPUs.
// fastxfer/__init__.py passes FASTXFER_THREADS here at import (through _core.configure); the core
// itself reads no environment variable.
void set_default_threads(int n);

// Persistent worker threads that sleep on a condition variable between calls. run(count, task)
// runs task(i) for i in [1, count) on workers and task(0) on the caller, and returns when all are
// done, rethrowing the first exception. One run at a time (callers serialise on owner()).
// Destroying the pool stops and joins its workers. A pool does not survive fork(): in a child
// process run() throws std::runtime_error, and destruction lets go of the (absent) threads.
class WorkerPool {
 public:
  WorkerPool();
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  std::mutex& owner() { return owner_; }
  void run(int count, FunctionRef<void(int)> task);
  // True in a child process that inherited this pool through fork(). Such a pool must be leaked,
  // not destroyed: its condition variables still count the parent's sleeping workers.
  bool inherited() const;

 private:
  void ensure_workers(int n);
  void loop(int index, uint64_t seen);

  std::mutex owner_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const FunctionRef<void(int)>* task_ = nullptr;
  int pending_ = 0;
  int active_ = 0;
  bool stop_ = false;
  pid_t pid_;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

// Runs fn(begin, end) over [0, n) split into at most `threads` contiguous ranges whose
// boundaries are multiples of `align` elements (so no two threads share a cache line).
// Ranges smaller than `min_per_thread` are not split further. The calling thread runs the
// first range itself. If the pool is busy with another caller, the work runs inline on the
// caller rather than waiting: two Python threads compressing at once never block each other.
void parallel_for(size_t n, int threads, size_t min_per_thread, size_t align,
                  FunctionRef<void(size_t, size_t)> fn);

}  // namespace fastxfer
