// A small persistent thread pool for splitting one memory-bound kernel call across cores.
#pragma once
#include <cstddef>
#include <functional>

namespace fastxfer {

// Threads used when the caller passes threads <= 0: FASTXFER_THREADS if set, else the number of
// CPUs in this process's affinity mask (so a numactl-bound worker does not oversubscribe).
int default_threads();

// Runs fn(begin, end) over [0, n) split into at most `threads` contiguous ranges whose
// boundaries are multiples of `align` elements (so no two threads share a cache line).
// Ranges smaller than `min_per_thread` are not split further. The calling thread runs the
// first range itself. If the pool is busy with another caller, the work runs inline on the
// caller rather than waiting: two Python threads compressing at once never block each other.
void parallel_for(size_t n, int threads, size_t min_per_thread, size_t align,
                  const std::function<void(size_t, size_t)>& fn);

}  // namespace fastxfer
