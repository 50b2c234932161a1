// Allreduce over shared memory, chunk by chunk through the double-buffered window: every rank
// packs (compresses, pre-scales) the chunk into its half, reduces the one shard it owns across all
// ranks in rank order (reduce-scatter), then copies every rank's reduced shard out, unpacking
// (decompressing) into its tensors (allgather). docs/algorithms.md counts the bytes.
//
// Across hosts (hierarchical.cc) each owned shard also goes through a cross-host stage between
// the reduce-scatter and the allgather. shm_allreduce_pipelined overlaps that stage with the
// shared-memory stages of the neighbouring chunks: chunk k's shard is on the network while this
// rank copies chunk k-1 out and packs and reduces chunk k+1 (the two window halves allow exactly
// one chunk in flight).
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

// One allreduce's chunking, and the three shared-memory steps of a chunk.
struct Chunker {
  ShmContext& c;
  const AllreduceJob& job;
  const Bucket& b;
  ShmSegment& seg;
  CommStats& st;
  const int n_ranks, me;
  const size_t es, align, own_es;
  const bool direct;  // my own contribution read straight from my tensors (no cross-host stage)
  size_t chunk = 0;
  std::vector<const void*>& srcs;  // one source per rank for a reduction: the context's, kept between calls

  // A chunk in progress: its window and element range.
  struct Part {
    WindowChunk ch;
    size_t lo, hi, shard;
    size_t shard_lo(int j) const { return std::min(hi - lo, shard * j); }
    size_t shard_hi(int j) const { return std::min(hi - lo, shard * (j + 1)); }
  };

  Chunker(ShmContext& ctx, const AllreduceJob& j, bool hooked, size_t max_chunk_bytes)
      : c(ctx), job(j), b(*j.bucket), seg(ctx.seg), st(ctx.stats), n_ranks(seg.size()), me(seg.rank()),
        es(dtype_size(b.wire_dtype)), align(64 / es), own_es(dtype_size(b.dtype)),
        // Read my own contribution straight from my tensors when no pre-scaling is needed and the
        // reduction kernel has a direct form for this dtype pair (float tensors on their own wire
        // format, bf16/fp16 included; float32 tensors on a compressed wire).
        direct(!hooked && j.prescale == 1.0 &&
               ((b.dtype == b.wire_dtype && (b.dtype == DType::kFloat32 || b.dtype == DType::kFloat64 ||
                                             b.dtype == DType::kBFloat16 || b.dtype == DType::kFloat16)) ||
                (b.dtype == DType::kFloat32 && b.wire_dtype != DType::kFloat32))),
        srcs(ctx.reduce_srcs) {
    srcs.resize(n_ranks);
    // Chunk: half a window (or less, max_chunk_bytes on the wire), split into one 64-byte-aligned
    // shard per rank. Chunks hold the same number of elements whatever the wire format (a
    // compressed chunk uses part of the window): the float32 inputs and outputs a chunk touches
    // stay cache-sized.
    const size_t unit = static_cast<size_t>(n_ranks) * align;
    size_t elems = seg.window_half_bytes() / std::max(es, own_es);
    if (max_chunk_bytes > 0) elems = std::min(elems, std::max(max_chunk_bytes / es, unit));
    chunk = std::max<size_t>(elems / unit, 1) * unit;
  }

  // Steps 1-3: wait for the window half, pack my chunk into it, reduce the shard I own. Returns
  // my reduced shard's place in my window (nullptr when I own none of this chunk).
  char* reduce_scatter(Part& p, uint64_t seq, bool scale_now) {
    // 1. Wait until every rank has finished reading this window half (the chunk protocol).
    p.ch = WindowChunk{static_cast<uint32_t>(seq), static_cast<int>(seq & 1)};
    if (seq >= 2) seg.wait_all(Phase::kConsumed, p.ch.g - 1, "allreduce (window reuse)");
    const size_t m = p.hi - p.lo;
    p.shard = (m + n_ranks * align - 1) / (n_ranks * align) * align;
    // 2. Pack (compress, pre-scale) the bucket straight into my window half. With `direct`, my
    //    own shard is skipped: only I read it, so step 3 takes it from my tensors instead.
    double t0 = now_s();
    char* mine = seg.window(me, p.ch.half);
    const size_t lo = p.lo, hi = p.hi, my_lo = lo + p.shard_lo(me), my_hi = lo + p.shard_hi(me);
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
    seg.publish(Phase::kReady, p.ch.done());
    // 3. Reduce-scatter: once everyone's chunk is in, reduce my shard across all ranks (rank
    //    order 0..N-1) and write it over my own copy of that shard (and, with `direct`, into my
    //    output tensors as well).
    seg.wait_all(Phase::kReady, p.ch.done(), "allreduce (reduce-scatter)");
    double t2 = now_s();
    st.wait += t2 - t1;
    char* out = nullptr;
    if (my_lo < my_hi) {
      if (direct) {
        for_each_segment(b, my_lo, my_hi, [&](const Segment& sg) {
          for (int j = 0; j < n_ranks; ++j) srcs[j] = seg.window(j, p.ch.half) + (sg.packed - lo) * es;
          srcs[me] = static_cast<const char*>(job.srcs[sg.tensor]) + sg.begin * own_es;
          reduce_block_direct(job.op, b.wire_dtype, b.dtype, srcs.data(), n_ranks, me, mine + (sg.packed - lo) * es,
                              static_cast<char*>(job.outs[sg.tensor]) + sg.begin * own_es, sg.count, job.postscale);
        });
      } else {
        for (int j = 0; j < n_ranks; ++j) srcs[j] = seg.window(j, p.ch.half) + p.shard_lo(me) * es;
        out = mine + p.shard_lo(me) * es;
        reduce_block(job.op, b.wire_dtype, srcs.data(), n_ranks, out, my_hi - my_lo, scale_now ? job.postscale : 1.0);
      }
    }
    st.reduce += now_s() - t2;
    return out;
  }

  size_t my_count(const Part& p) const { return p.shard_hi(me) - p.shard_lo(me); }

  // Step 4: publish my reduced shard, copy every rank's out of its window into the output tensors
  // (decompressing on the way), my own first unless step 3 already wrote it; then step 5.
  void allgather(const Part& p) {
    seg.publish(Phase::kReduced, p.ch.done());
    for (int k = direct ? 1 : 0; k < n_ranks; ++k) {
      int j = (me + k) % n_ranks;
      if (p.shard_lo(j) >= p.shard_hi(j)) continue;
      double tw = now_s();
      if (j != me) seg.wait_one(j, Phase::kReduced, p.ch.done(), "allreduce (allgather)");
      double tu = now_s();
      st.wait += tu - tw;
      unpack_range(b, seg.window(j, p.ch.half) + p.shard_lo(j) * es, job.outs, p.lo + p.shard_lo(j),
                   p.lo + p.shard_hi(j), 1.0, c.threads);
      st.unpack += now_s() - tu;
    }
    ++st.chunks;
    st.bytes += (p.hi - p.lo) * es;
    // 5. Done reading everyone's half: it may be reused two chunks from now.
    seg.publish(Phase::kConsumed, p.ch.done());
  }
};

}  // namespace

void shm_allreduce(ShmContext& c, const AllreduceJob& job, const ShardHook& between) {
  Chunker k(c, job, static_cast<bool>(between), 0);
  // A large bucket's outputs go straight to memory: keeping them in cache would only evict the
  // windows and inputs this rank is still reading (about 25% faster at 64 MB on 2 ranks).
  ScopedStreamStores stream(k.b.numel * k.own_es >= c.stream_min_bytes);
  for (size_t lo = 0; lo < k.b.numel; lo += k.chunk) {
    Chunker::Part p{};
    p.lo = lo;
    p.hi = std::min(k.b.numel, lo + k.chunk);
    char* shard = k.reduce_scatter(p, c.chunk, !between);
    if (between && shard != nullptr) between(shard, k.my_count(p), k.b.wire_dtype);
    k.allgather(p);
    ++c.chunk;
  }
}

void shm_allreduce_pipelined(ShmContext& c, const AllreduceJob& job, const ShardPipeline& pipe) {
  Chunker k(c, job, true, pipe.max_chunk_bytes);
  ScopedStreamStores stream(k.b.numel * k.own_es >= c.stream_min_bytes);
  Chunker::Part prev{};
  bool prev_open = false, prev_sent = false;
  // The chunk whose shard is on the network is finished (waited for, published, copied out)
  // after the next chunk's shard has gone out: one cross-host stage is always in flight.
  auto finish_prev = [&] {
    if (prev_sent) pipe.finish();
    k.allgather(prev);
    ++c.chunk;
    prev_open = prev_sent = false;
  };
  for (size_t lo = 0; lo < k.b.numel; lo += k.chunk) {
    Chunker::Part p{};
    p.lo = lo;
    p.hi = std::min(k.b.numel, lo + k.chunk);
    // this chunk's sequence number: the previous one is not counted in c.chunk until it ends
    char* shard = k.reduce_scatter(p, c.chunk + (prev_open ? 1 : 0), false);
    const bool sent = shard != nullptr;
    if (sent) pipe.start(shard, k.my_count(p), k.b.wire_dtype);
    if (prev_open) finish_prev();
    prev = p;
    prev_open = true;
    prev_sent = sent;
  }
  if (prev_open) finish_prev();
}

}  // namespace fastxfer
