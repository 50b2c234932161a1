// Allreduce over shared memory, chunk by chunk through the double-buffered window: every rank
// packs (compresses, pre-scales) the chunk into its half, reduces the one shard it owns across all
// ranks in rank order (reduce-scatter), then copies every rank's reduced shard out, unpacking
// (decompressing) into its tensors (allgather). docs/algorithms.md counts the bytes.
#include <algorithm>
#include <chrono>

#include "collectives/shm_context.h"
#include "fusion/pack.h"
#include "kernels/kernels.h"
#include "kernels/reduce.h"

namespace fastxfer {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void shm_allreduce(ShmContext& c, const AllreduceJob& job, const ShardHook& between) {
  ShmSegment& seg = c.seg;
  CommStats& st = c.stats;
  const Bucket& b = *job.bucket;
  const int n_ranks = seg.size(), me = seg.rank();
  const size_t es = dtype_size(b.wire_dtype);
  const size_t align = 64 / es;
  const size_t own_es = dtype_size(b.dtype);
  // Read my own contribution straight from my tensors when no pre-scaling is needed and the
  // reduction kernel has a direct form for this dtype pair (float tensors on their own wire
  // format, bf16/fp16 included; float32 tensors on a compressed wire).
  const bool direct = !between && job.prescale == 1.0 &&
                      ((b.dtype == b.wire_dtype && (b.dtype == DType::kFloat32 || b.dtype == DType::kFloat64 ||
                                                    b.dtype == DType::kBFloat16 || b.dtype == DType::kFloat16)) ||
                       (b.dtype == DType::kFloat32 && b.wire_dtype != DType::kFloat32));
  // Chunk: half a window, split into one 64-byte-aligned shard per rank.
  // Chunks hold the same number of elements whatever the wire format (a compressed chunk uses
  // part of the window): the float32 inputs and outputs a chunk touches stay cache-sized.
  const size_t chunk =
      (seg.window_half_bytes() / std::max<size_t>(es, own_es)) / (n_ranks * align) * (n_ranks * align);
  std::vector<const void*> srcs(n_ranks);
  // A large bucket's outputs go straight to memory: keeping them in cache would only evict the
  // windows and inputs this rank is still reading (about 25% faster at 64 MB on 2 ranks).
  const bool stream_big = b.numel * own_es >= c.stream_min_bytes;
  ScopedStreamStores stream(stream_big);
  for (size_t lo = 0; lo < b.numel; lo += chunk) {
    const size_t hi = std::min(b.numel, lo + chunk), m = hi - lo;
    const size_t shard = (m + n_ranks * align - 1) / (n_ranks * align) * align;
    auto shard_lo = [&](int j) { return std::min(m, shard * j); };
    auto shard_hi = [&](int j) { return std::min(m, shard * (j + 1)); };
    // 1. Wait until every rank has finished reading this window half (the chunk protocol).
    const WindowChunk ch = begin_chunk(c, "allreduce (window reuse)");
    // 2. Pack (compress, pre-scale) the bucket straight into my window half. With `direct`, my
    //    own shard is skipped: only I read it, so step 3 takes it from my tensors instead.
    double t0 = now_s();
    char* mine = seg.window(me, ch.half);
    const size_t my_lo = lo + shard_lo(me), my_hi = lo + shard_hi(me);
    {
      // Packing into the window keeps normal stores: the peers read it right away.
      ScopedStreamStores cached(false);
      if (direct) {
        if (my_lo > lo) pack_range(b, job.srcs, mine, lo, my_lo, job.prescale, c.threads);
        if (hi > my_hi) pack_range(b, job.srcs, mine + (my_hi - lo) * es, my_hi, hi, job.prescale, c.threads);
      } else {
        pack_range(b, job.srcs, mine, lo, hi, job.prescale, c.threads);
      }
    }
    double t1 = now_s();
    st.pack += t1 - t0;
    seg.publish(Phase::kReady, ch.done());
    // 3. Reduce-scatter: once everyone's chunk is in, reduce my shard across all ranks (rank
    //    order 0..N-1) and write it over my own copy of that shard (and, with `direct`, into my
    //    output tensors as well).
    seg.wait_all(Phase::kReady, ch.done(), "allreduce (reduce-scatter)");
    double t2 = now_s();
    st.wait += t2 - t1;
    if (my_lo < my_hi) {
      if (direct) {
        for (const Segment& sg : segments(b, my_lo, my_hi)) {
          for (int j = 0; j < n_ranks; ++j) srcs[j] = seg.window(j, ch.half) + (sg.packed - lo) * es;
          srcs[me] = static_cast<const char*>(job.srcs[sg.tensor]) + sg.begin * own_es;
          reduce_block_direct(job.op, b.wire_dtype, b.dtype, srcs.data(), n_ranks, me, mine + (sg.packed - lo) * es,
                              static_cast<char*>(job.outs[sg.tensor]) + sg.begin * own_es, sg.count, job.postscale);
        }
      } else {
        for (int j = 0; j < n_ranks; ++j) srcs[j] = seg.window(j, ch.half) + shard_lo(me) * es;
        reduce_block(job.op, b.wire_dtype, srcs.data(), n_ranks, mine + shard_lo(me) * es, my_hi - my_lo,
                     between ? 1.0 : job.postscale);
        if (between) between(mine + shard_lo(me) * es, my_hi - my_lo, b.wire_dtype);
      }
    }
    double t3 = now_s();
    st.reduce += t3 - t2;
    seg.publish(Phase::kReduced, ch.done());
    // 4. Allgather: copy every rank's reduced shard out of its window into the output tensors
    //    (decompressing on the way), my own first unless step 3 already wrote it.
    for (int k = direct ? 1 : 0; k < n_ranks; ++k) {
      int j = (me + k) % n_ranks;
      if (shard_lo(j) >= shard_hi(j)) continue;
      double tw = now_s();
      if (j != me) seg.wait_one(j, Phase::kReduced, ch.done(), "allreduce (allgather)");
      double tu = now_s();
      st.wait += tu - tw;
      unpack_range(b, seg.window(j, ch.half) + shard_lo(j) * es, job.outs, lo + shard_lo(j), lo + shard_hi(j), 1.0,
                   c.threads);
      st.unpack += now_s() - tu;
    }
    ++st.chunks;
    st.bytes += m * es;
    // 5. Done reading everyone's half: it may be reused two chunks from now.
    end_chunk(c, ch);
  }
}

}  // namespace fastxfer
