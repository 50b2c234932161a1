// What the shared-memory collectives share: the segment, the sequence numbers that keep every
// rank's use of it in lock-step, and the one chunk protocol they all stream through.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "collectives/collectives.h"
#include "transport/shm/segment.h"

namespace fastxfer {

struct ShmContext {
  explicit ShmContext(ShmSegment& s) : seg(s) {}
  ShmSegment& seg;
  int threads = 1;                     // threads for pack/unpack inside one chunk
  size_t stream_min_bytes = 4u << 20;  // buckets whose outputs are this large use streaming stores
  // Sequence numbers, the same on every rank. 64-bit here so "is this the first use" tests never
  // wrap; the shared counters carry the low 32 bits (compared with serial arithmetic).
  uint64_t chunk = 0;    // window chunks done (by every collective that streams through the window)
  uint64_t round = 0;    // negotiation rounds done
  uint64_t oob_seq = 0;  // out-of-band reductions done
  CommStats stats;
  // Working storage of the chunked allreduce (its per-rank sources), kept between calls so a
  // small bucket allocates nothing. One collective at a time uses a context.
  std::vector<const void*> reduce_srcs;
};

// The window protocol, written once. Chunk g uses half g & 1 of every rank's window:
//   begin: wait until every rank has consumed chunk g - 2, the last one to use this half;
//   (the collective writes its half, publishes kReady, reads the peers' halves ...)
//   end:   publish kConsumed = g + 1 (I read all I need from everyone's half) and move on.
struct WindowChunk {
  uint32_t g;    // low 32 bits of the chunk's sequence number (what the counters carry)
  int half;      // which half of each window this chunk uses
  uint32_t done() const { return g + 1; }  // the counter value that says "this chunk's step is done"
};

inline WindowChunk begin_chunk(ShmContext& c, const char* what) {
  WindowChunk ch{static_cast<uint32_t>(c.chunk), static_cast<int>(c.chunk & 1)};
  // this half was last used two chunks ago: wait until every rank has finished reading it
  if (c.chunk >= 2) c.seg.wait_all(Phase::kConsumed, ch.g - 1, what);
  return ch;
}

inline void end_chunk(ShmContext& c, const WindowChunk& ch) {
  c.seg.publish(Phase::kConsumed, ch.done());
  ++c.chunk;
}

// One algorithm per file (collectives/shm_*.cc); docs/algorithms.md lists their steps and bytes.

// Agree on the next requests: every rank's record list, indexed by rank (shm_negotiate.cc).
void shm_exchange_records(ShmContext& c, const std::vector<Record>& mine, std::vector<std::vector<Record>>& all);

// The one-exchange path for small allreduces (shm_eager.cc): before the round's exchange, pack the
// offered bucket into this rank's data slot of the round's record buffer and say how many requests
// it covers; after it, the minimum every rank covered, and a prefix of that bucket reduced from
// every rank's slot in rank order (postscale applied, outputs written), or (`partial`) into
// `partial` unscaled, in the wire dtype, for a cross-host stage.
void shm_eager_offer(ShmContext& c, const AllreduceJob* job, uint32_t count);
uint32_t shm_eager_agreed(const ShmContext& c);
void shm_eager_allreduce(ShmContext& c, const AllreduceJob& job);
void shm_eager_partial(ShmContext& c, const Bucket& b, size_t numel, ReduceOp op, void* partial);

// For the hierarchical allreduce: after the shard a rank owns is reduced within the host (and
// before anyone copies it), `between(shard, n, wire)` runs on it; postscale is then its job.
using ShardHook = std::function<void(char* shard, size_t n, DType wire)>;
// Reduce-scatter then allgather through the window, chunk by chunk (shm_allreduce.cc).
void shm_allreduce(ShmContext& c, const AllreduceJob& job, const ShardHook& between);
// The same with the cross-host stage overlapped: `start(shard, n, wire)` hands a chunk's reduced
// shard to the network and returns at once; `finish()` waits for the oldest shard started and
// not yet finished (and scales it: postscale is its job). At most one is in flight: chunk k's
// shard travels while this rank copies chunk k-1 out and packs and reduces chunk k+1. Chunks
// hold at most `max_chunk_bytes` on the wire (0: half a window), so the pipeline fills early.
struct ShardPipeline {
  std::function<void(char* shard, size_t n, DType wire)> start;
  std::function<void()> finish;
  size_t max_chunk_bytes = 0;
};
void shm_allreduce_pipelined(ShmContext& c, const AllreduceJob& job, const ShardPipeline& pipe);
void shm_broadcast(ShmContext& c, const void* in, void* out, size_t nbytes, int root);     // shm_broadcast.cc
void shm_allgather(ShmContext& c, const void* in, void* out, const std::vector<size_t>& bytes);  // shm_allgather.cc
// Each chunk, every rank stages one slot per destination in its half; the others copy theirs out (shm_alltoall.cc).
void shm_alltoall(ShmContext& c, const void* in, void* out, const std::vector<size_t>& bytes);
// Each chunk, every rank stages the piece of each peer's region; each owner reduces its own (shm_reducescatter.cc).
void shm_reducescatter(ShmContext& c, const ReducescatterJob& job);
// Through each rank's out-of-band slot, never the window (shm_oob_allreduce.cc).
void shm_oob_allreduce(ShmContext& c, const Record& rec, const void* in, void* out, size_t n, DType dtype,
                       ReduceOp op, double postscale);
inline size_t shm_oob_capacity(const ShmContext& c) { return c.seg.config().oob_bytes - sizeof(Record); }

}  // namespace fastxfer
