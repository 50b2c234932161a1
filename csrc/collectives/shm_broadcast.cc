// Broadcast over shared memory: the root copies each chunk into its window half, the others copy
// it out. Bytes per chunk: the root writes it once, every other rank reads it once.
#include <algorithm>
#include <cstring>

#include "collectives/shm_context.h"

namespace fastxfer {

void shm_broadcast(ShmContext& c, const void* in, void* out, size_t nbytes, int root) {
  ShmSegment& seg = c.seg;
  const int me = seg.rank();
  const size_t half_bytes = seg.window_half_bytes();
  for (size_t off = 0; off < nbytes; off += half_bytes) {
    const size_t len = std::min(half_bytes, nbytes - off);
    const WindowChunk ch = begin_chunk(c, "broadcast (window reuse)");
    // 1. The root stages the chunk (and fills its own output).
    if (me == root) {
      std::memcpy(seg.window(root, ch.half), static_cast<const char*>(in) + off, len);
      if (out != in) std::memcpy(static_cast<char*>(out) + off, static_cast<const char*>(in) + off, len);
    }
    seg.publish(Phase::kReady, ch.done());
    // 2. Everyone else waits for the root's chunk and copies it out.
    if (me != root) {
      seg.wait_one(root, Phase::kReady, ch.done(), "broadcast");
      std::memcpy(static_cast<char*>(out) + off, seg.window(root, ch.half), len);
    }
    end_chunk(c, ch);
  }
}

}  // namespace fastxfer
