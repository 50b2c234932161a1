// The output pool (output_pool.h): page-aligned result buffers, cached by size after release.
// bindings/pool.cc binds it (fastxfer._core.pool_empty hands out numpy arrays whose memory comes
// from here and comes back when the array, and every view of it, is gone).
#include "common/output_pool.h"

#include "common/log.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fastxfer {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kDefaultCap = size_t(256) << 20;

size_t page_size() {
  static const size_t p = [] {
    long v = sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<size_t>(v) : size_t(4096);
  }();
  return p;
}

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Fresh anonymous memory. From 2 MiB up the mapping is 2 MiB-aligned (over-map, then unmap the
// ragged ends) and marked MADV_HUGEPAGE: only aligned 2 MiB ranges can become huge pages, and
// with them the first touch costs one fault per 2 MiB instead of one per 4 KiB (numpy asks the
// same for its own large arrays, so pool arrays and np.empty arrays see the same TLB).
void* map_fresh(size_t bytes) {
  if (bytes < kHugePage) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
  const size_t span = bytes + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  char* base = static_cast<char*>(raw);
  char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(base), kHugePage));
  const size_t head = static_cast<size_t>(aligned - base), tail = span - head - bytes;
  if (head) munmap(base, head);
  if (tail) munmap(aligned + bytes, tail);
#ifdef MADV_HUGEPAGE
  madvise(aligned, bytes, MADV_HUGEPAGE);  // a hint: harmless where transparent huge pages are off
#endif
  return aligned;
}

using Unmaps = std::vector<std::pair<void*, size_t>>;

// Invariants (under `mu`): a buffer is either live (in `live`) or cached (in both `by_size` and
// `by_age`), never both; cached_bytes / live_bytes are the sums of those sets' sizes;
// cached_bytes <= cap after every release.
struct Pool {
  std::mutex mu;
  size_t cap = kDefaultCap;
  // Cached buffers by page-rounded size, the most recently released last (warmest in cache:
  // handed out first), and the same buffers by release order (oldest evicted first).
  std::unordered_map<size_t, std::vector<std::pair<uint64_t, void*>>> by_size;
  std::map<uint64_t, std::pair<size_t, void*>> by_age;
  std::unordered_map<void*, size_t> live;
  uint64_t seq = 0;
  size_t cached_bytes = 0, live_bytes = 0;
  uint64_t hits = 0, misses = 0, evictions = 0, bad_releases = 0;

  // Drops the oldest cached buffers until at most `limit` bytes stay cached; the caller unmaps
  // them after unlocking (munmap is a system call: nobody should wait on the lock for it).
  void evict_to(size_t limit, Unmaps& out) {
    while (cached_bytes > limit && !by_age.empty()) {
      auto oldest = by_age.begin();
      const auto [n, p] = oldest->second;
      auto& same = by_size[n];
      same.erase(std::find(same.begin(), same.end(), std::make_pair(oldest->first, p)));
      if (same.empty()) by_size.erase(n);
      by_age.erase(oldest);
      cached_bytes -= n;
      ++evictions;
      out.emplace_back(p, n);
    }
  }
};

void unmap_all(const Unmaps& u) {
  for (const auto& [p, n] : u) munmap(p, n);
}

// fork() while another thread holds the lock would leave the child's copy locked forever: take it
// around fork so the child starts with a consistent pool. The cached buffers stay valid in the
// child (private mappings are copied); arrays the child inherits release into the child's pool.
void lock_for_fork();
void unlock_after_fork();

Pool& pool() {
  // Never destroyed: arrays may give buffers back during interpreter shutdown, after static
  // destructors would have run.
  static Pool* p = [] {
    Pool* made = new Pool;
    pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
    return made;
  }();
  return *p;
}

void lock_for_fork() { pool().mu.lock(); }
void unlock_after_fork() { pool().mu.unlock(); }

std::atomic<bool> g_reported_bad{false};

}  // namespace

void* pool_acquire(size_t bytes) {
  const size_t n = round_up(std::max<size_t>(bytes, 1), page_size());
  Pool& P = pool();
  {
    std::lock_guard<std::mutex> g(P.mu);
    auto it = P.by_size.find(n);
    if (it != P.by_size.end()) {
      const auto [seq, p] = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) P.by_size.erase(it);
      P.by_age.erase(seq);
      P.cached_bytes -= n;
      P.live.emplace(p, n);
      P.live_bytes += n;
      ++P.hits;
      return p;
    }
    ++P.misses;
  }
  void* p = map_fresh(n);
  try {
    std::lock_guard<std::mutex> g(P.mu);
    P.live.emplace(p, n);
    P.live_bytes += n;
  } catch (...) {
    munmap(p, n);
    throw;
  }
  return p;
}

void pool_release(void* p, size_t bytes) noexcept {
  (void)bytes;  // the size is known from acquire; the argument only documents the caller's view
  if (p == nullptr) return;
  Pool& P = pool();
  Unmaps unmap;
  bool bad = false;
  {
    std::lock_guard<std::mutex> g(P.mu);
    auto it = P.live.find(p);
    if (it == P.live.end()) {
      ++P.bad_releases;
      bad = true;
    } else {
      const size_t n = it->second;
      P.live.erase(it);
      P.live_bytes -= n;
      try {
        if (n > P.cap) {
          unmap.emplace_back(p, n);
        } else {
          P.evict_to(P.cap - n, unmap);
          const uint64_t s = ++P.seq;
          P.by_size[n].emplace_back(s, p);
          try {
            P.by_age.emplace(s, std::make_pair(n, p));
          } catch (...) {
            P.by_size[n].pop_back();
            throw;
          }
          P.cached_bytes += n;
        }
      } catch (...) {  // no memory for the bookkeeping: give the buffer back to the system instead
        unmap.emplace_back(p, n);
      }
    }
  }
  if (bad && !g_reported_bad.exchange(true))
    log_line(kLogError, "output pool: release of a buffer that is not live (ignored; reported once)");
  unmap_all(unmap);
}

PoolStats pool_stats() {
  Pool& P = pool();
  std::lock_guard<std::mutex> g(P.mu);
  return {P.cap, P.cached_bytes, P.by_age.size(), P.live_bytes, P.live.size(),
          P.hits, P.misses, P.evictions, P.bad_releases};
}

void pool_set_cap(size_t bytes) {
  Pool& P = pool();
  Unmaps unmap;
  {
    std::lock_guard<std::mutex> g(P.mu);
    P.cap = bytes;
    P.evict_to(bytes, unmap);
  }
  unmap_all(unmap);
}

void pool_trim() {
  Pool& P = pool();
  Unmaps unmap;
  {
    std::lock_guard<std::mutex> g(P.mu);
    P.evict_to(0, unmap);
  }
  unmap_all(unmap);
}

}  // namespace fastxfer
