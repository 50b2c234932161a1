// Alltoall over shared memory: rank i sends its j-th block (any size, even 0) to rank j. Each chunk,
// every rank stages the next piece of each of its blocks in its window half, one 64-byte-aligned slot
// per destination, publishes, and copies out of every peer's half the slot addressed to it. Its own
// block never enters the window. docs/algorithms.md counts the bytes.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "collectives/shm_context.h"

namespace fastxfer {

void shm_alltoall(ShmContext& c, const void* in, void* out, const std::vector<size_t>& bytes) {
  ShmSegment& seg = c.seg;
  CommStats& st = c.stats;
  const size_t n = static_cast<size_t>(seg.size()), me = static_cast<size_t>(seg.rank());
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<size_t> send_off(n + 1, 0), recv_off(n + 1, 0);
  size_t most = 0;  // the largest block between two different ranks: every rank computes the same
  for (size_t j = 0; j < n; ++j) {
    send_off[j + 1] = send_off[j] + bytes[me * n + j];
    recv_off[j + 1] = recv_off[j] + bytes[j * n + me];
    for (size_t i = 0; i < n; ++i)
      if (i != j) most = std::max(most, bytes[i * n + j]);
  }
  const auto t0 = std::chrono::steady_clock::now();
  // 1. My block for myself: one copy, no window.
  if (bytes[me * n + me]) std::memcpy(dst + recv_off[me], src + send_off[me], bytes[me * n + me]);
  // Half a window holds one slot per destination (the segment guarantees >= 128 bytes per rank).
  const size_t slot = seg.window_half_bytes() / n / 64 * 64;
  for (size_t off = 0; off < most; off += slot) {
    auto piece = [&](size_t from, size_t to) {
      const size_t b = bytes[from * n + to];
      return off < b ? std::min(slot, b - off) : size_t(0);
    };
    // 2. Wait until nobody still reads this half; stage my piece for every other rank.
    const WindowChunk ch = begin_chunk(c, "alltoall (window reuse)");
    char* mine = seg.window(static_cast<int>(me), ch.half);
    for (size_t j = 0; j < n; ++j)
      if (j != me && piece(me, j)) std::memcpy(mine + j * slot, src + send_off[j] + off, piece(me, j));
    seg.publish(Phase::kReady, ch.done());
    // 3. Copy the slot addressed to me out of every peer's half, starting with my right neighbour
    //    (so the ranks do not all read rank 0's half first).
    for (size_t k = 1; k < n; ++k) {
      const size_t j = (me + k) % n;
      const size_t len = piece(j, me);
      if (!len) continue;
      seg.wait_one(static_cast<int>(j), Phase::kReady, ch.done(), "alltoall");
      std::memcpy(dst + recv_off[j] + off, seg.window(static_cast<int>(j), ch.half) + me * slot, len);
    }
    ++st.chunks;
    // 4. Done reading everyone's half.
    end_chunk(c, ch);
  }
  st.bytes += send_off[n];
  st.unpack += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace fastxfer
