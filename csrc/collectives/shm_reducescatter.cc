// Reduce-scatter over shared memory: rank r owns region r of the tensor (counts[r] elements, in
// rank order) and ends with that region reduced across all ranks. Each chunk, every rank stages
// the next piece of every other rank's region in its window half (one 64-byte-aligned slot per
// owner), publishes, and reduces its own piece: its own contribution straight from its tensor, the
// others' from their halves, in rank order 0..N-1, written straight into its output. It is the
// first half of the shared-memory allreduce (shm_allreduce.cc) with the shards where the caller
// wants them. docs/algorithms.md counts the bytes.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "collectives/shm_context.h"
#include "kernels/reduce.h"

namespace fastxfer {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void shm_reducescatter(ShmContext& c, const ReducescatterJob& job) {
  ShmSegment& seg = c.seg;
  CommStats& st = c.stats;
  const int n = seg.size(), me = seg.rank();
  const size_t es = dtype_size(job.dtype);
  const char* src = static_cast<const char*>(job.in);
  std::vector<size_t> start(n + 1, 0);
  for (int j = 0; j < n; ++j) start[j + 1] = start[j] + job.counts[j];
  const size_t most = *std::max_element(job.counts.begin(), job.counts.end());
  // One slot per owner in half a window, 64-byte aligned (the segment guarantees >= 128 B per rank).
  const size_t slot_bytes = seg.window_half_bytes() / n / 64 * 64;
  const size_t slot = slot_bytes / es;
  std::vector<const void*> srcs(n);
  for (size_t off = 0; off < most; off += slot) {
    auto piece = [&](int j) { return off < job.counts[j] ? std::min(slot, job.counts[j] - off) : size_t(0); };
    // 1. Wait until nobody still reads this half; stage my contribution to every other owner.
    const WindowChunk ch = begin_chunk(c, "reducescatter (window reuse)");
    const double t0 = now_s();
    char* mine = seg.window(me, ch.half);
    for (int j = 0; j < n; ++j)
      if (j != me && piece(j)) std::memcpy(mine + j * slot_bytes, src + (start[j] + off) * es, piece(j) * es);
    const double t1 = now_s();
    st.pack += t1 - t0;
    seg.publish(Phase::kReady, ch.done());
    // 2. Once every contribution to my piece is staged, reduce it into my output.
    if (const size_t m = piece(me)) {
      seg.wait_all(Phase::kReady, ch.done(), "reducescatter");
      const double t2 = now_s();
      st.wait += t2 - t1;
      for (int j = 0; j < n; ++j) srcs[j] = seg.window(j, ch.half) + me * slot_bytes;
      srcs[me] = src + (start[me] + off) * es;
      reduce_block(job.op, job.dtype, srcs.data(), n, static_cast<char*>(job.out) + off * es, m, job.scale);
      st.reduce += now_s() - t2;
    }
    ++st.chunks;
    for (int j = 0; j < n; ++j) st.bytes += piece(j) * es;
    // 3. Done reading everyone's half.
    end_chunk(c, ch);
  }
}

}  // namespace fastxfer
