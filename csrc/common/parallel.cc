// Thread pools: WorkerPool (workers sleep on a condition variable between calls; a generation
// counter hands out each call) and the process-wide pool behind parallel_for.
#include "common/parallel.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace fastxfer {

namespace {
std::atomic<int> g_default_threads{0};  // 0: the affinity mask's CPUs
}  // namespace

void set_default_threads(int n) { g_default_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

int default_threads() {
  if (int v = g_default_threads.load(std::memory_order_relaxed); v > 0) return v;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int c = CPU_COUNT(&set);
    if (c > 0) return c;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

WorkerPool::WorkerPool() : pid_(getpid()) {}

bool WorkerPool::inherited() const { return getpid() != pid_; }

WorkerPool::~WorkerPool() {
  if (inherited()) {
    // A copy inherited through fork(): its threads do not exist here, so they can be neither
    // joined nor detached (and a joinable std::thread must not be destroyed): leak the handles.
    // (Owners should not destroy an inherited pool at all -- its condition variables still
    // count the parent's waiters, and destroying them would wait forever -- see inherited().)
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    ++generation_;
  }
  cv_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
}

void WorkerPool::run(int count, FunctionRef<void(int)> task) {
  if (inherited())
    throw std::runtime_error("a thread pool created before fork() cannot run in the child process: "
                             "create the object (e.g. the Loader) again after forking");
  if (count <= 1) {
    if (count == 1) task(0);
    return;
  }
  ensure_workers(count - 1);
  {
    std::lock_guard<std::mutex> lk(mu_);
    task_ = &task;
    pending_ = count - 1;
    active_ = count - 1;
    error_ = nullptr;
    ++generation_;
  }
  cv_.notify_all();
  std::exception_ptr caller_error;
  try {
    task(0);
  } catch (...) {
    caller_error = std::current_exception();
  }
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  task_ = nullptr;
  if (caller_error) std::rethrow_exception(caller_error);
  if (error_) std::rethrow_exception(error_);
}

void WorkerPool::ensure_workers(int n) {
  while (static_cast<int>(workers_.size()) < n) {
    int index = static_cast<int>(workers_.size()) + 1;  // task index this worker runs
    uint64_t start;
    {
      std::lock_guard<std::mutex> lk(mu_);
      start = generation_;  // a new worker must not take part in a finished generation
    }
    workers_.emplace_back([this, index, start] { loop(index, start); });
  }
}

void WorkerPool::loop(int index, uint64_t seen) {
  for (;;) {
    const FunctionRef<void(int)>* task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (stop_) return;
      // Only the first `active_` workers take part in this generation.
      if (index > active_) continue;
      task = task_;
    }
    std::exception_ptr err;
    try {
      (*task)(index);
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (err && !error_) error_ = err;
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

namespace {

// The process-wide pool. Leaked on purpose: joining threads from a static destructor at
// interpreter exit can deadlock, and the OS reclaims them anyway. A forked child has none of the
// parent's workers (and maybe a mutex held by one of them): it starts a fresh pool, leaking the
// copied one.
WorkerPool*& global_slot() {
  static WorkerPool* pool = nullptr;
  return pool;
}

WorkerPool& global_pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    global_slot() = new WorkerPool();
    pthread_atfork(nullptr, nullptr, [] { global_slot() = new WorkerPool(); });
  });
  return *global_slot();
}

}  // namespace

void parallel_for(size_t n, int threads, size_t min_per_thread, size_t align,
                  FunctionRef<void(size_t, size_t)> fn) {
  if (n == 0) return;
  if (threads <= 0) threads = default_threads();
  if (align == 0) align = 1;
  if (min_per_thread == 0) min_per_thread = 1;
  size_t max_parts = std::max<size_t>(1, n / min_per_thread);
  size_t parts = std::min<size_t>(static_cast<size_t>(threads), max_parts);
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  WorkerPool& pool = global_pool();
  std::unique_lock<std::mutex> own(pool.owner(), std::try_to_lock);
  if (!own.owns_lock()) {
    fn(0, n);
    return;
  }
  // Even split, each boundary rounded up to a multiple of `align`.
  size_t per = (n + parts - 1) / parts;
  per = (per + align - 1) / align * align;
  parts = (n + per - 1) / per;
  pool.run(static_cast<int>(parts), [&](int i) {
    size_t b = static_cast<size_t>(i) * per;
    size_t e = std::min(n, b + per);
    if (b < e) fn(b, e);
  });
}

}  // namespace fastxfer
