// Allgather over shared memory: each chunk, every rank stages its next piece in its window half and
// copies the others' pieces out, in rank order. Ranks may contribute different byte counts.
#include <algorithm>
#include <cstring>

#include "collectives/shm_context.h"

namespace fastxfer {

void shm_allgather(ShmContext& c, const void* in, void* out, const std::vector<size_t>& bytes) {
  ShmSegment& seg = c.seg;
  const int me = seg.rank();
  const size_t half_bytes = seg.window_half_bytes();
  std::vector<size_t> start(bytes.size() + 1, 0);
  size_t most = 0;
  for (size_t j = 0; j < bytes.size(); ++j) {
    start[j + 1] = start[j] + bytes[j];
    most = std::max(most, bytes[j]);
  }
  for (size_t off = 0; off < most; off += half_bytes) {
    const WindowChunk ch = begin_chunk(c, "allgather (window reuse)");
    auto piece = [&](int j) { return off < bytes[j] ? std::min(half_bytes, bytes[j] - off) : size_t(0); };
    // 1. Stage my piece of this chunk (and copy it to my own output).
    if (piece(me)) {
      std::memcpy(seg.window(me, ch.half), static_cast<const char*>(in) + off, piece(me));
      std::memcpy(static_cast<char*>(out) + start[me] + off, static_cast<const char*>(in) + off, piece(me));
    }
    seg.publish(Phase::kReady, ch.done());
    // 2. Copy every other rank's piece out as soon as it is staged.
    for (int j = 0; j < seg.size(); ++j) {
      if (j == me || !piece(j)) continue;
      seg.wait_one(j, Phase::kReady, ch.done(), "allgather");
      std::memcpy(static_cast<char*>(out) + start[j] + off, seg.window(j, ch.half), piece(j));
    }
    end_chunk(c, ch);
  }
}

}  // namespace fastxfer
