// The output pool: page-aligned buffers for the results of collectives, kept after their array
// dies and handed to the next request of the same size, so that a training loop stops paying the
// page faults (and the kernel's zeroing) of fresh memory on every call. docs/architecture.md
// (§ Fresh outputs) has the measurements behind this choice.
//
// Plain C++ (no pybind11), so that other native callers can take their output buffers here too;
// bindings/pool.cc binds it for Python.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fastxfer {

// A buffer of at least `bytes` bytes (a whole number of pages; contents undefined), page-aligned,
// and 2 MiB-aligned with transparent huge pages requested when it is 2 MiB or larger. A cached
// buffer of the same page-rounded size is reused when there is one; otherwise a fresh one is
// mapped. The buffer is live until pool_release: it is never handed out again before that.
// Throws std::bad_alloc when the memory cannot be mapped. Thread-safe.
void* pool_acquire(size_t bytes);

// Gives a buffer from pool_acquire back. `bytes` is the size it was acquired with, or 0 for "the
// size it was acquired with". It is cached for reuse, unless it alone is larger than the cap; the
// least recently released buffers are unmapped to keep the cached bytes within the cap. A pointer
// that is not live (never acquired, or released already) is refused with a message on stderr and
// counted, never cached: handing it out twice would give two owners the same memory. Thread-safe,
// never throws (it runs in destructors).
void pool_release(void* p, size_t bytes) noexcept;

struct PoolStats {
  size_t cap_bytes;        // at most this many bytes are kept cached
  size_t cached_bytes;     // held for reuse now
  size_t cached_buffers;
  size_t live_bytes;       // handed out and not yet released
  size_t live_buffers;
  uint64_t hits;           // acquires served from the cache
  uint64_t misses;         // acquires that mapped fresh memory
  uint64_t evictions;      // cached buffers unmapped to stay within the cap
  uint64_t bad_releases;   // releases of pointers that were not live (refused)
};
PoolStats pool_stats();

// Sets the cap (bytes; 0 disables caching: every release unmaps) and evicts down to it. The default
// is 256 MiB; fastxfer/__init__.py passes FASTXFER_OUTPUT_POOL_MB here at import (_core.configure).
void pool_set_cap(size_t bytes);
// Unmaps every cached buffer (live ones are untouched).
void pool_trim();

}  // namespace fastxfer
