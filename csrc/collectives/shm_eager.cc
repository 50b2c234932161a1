// The one-exchange path for small allreduces: each rank packs the round's leading small allreduces
// into the data slot that belongs to the round's record buffer, before it publishes its records.
// Once every rank's records are in (the negotiation's one wait), every rank reduces the agreed
// prefix from all the slots itself, in rank order, and is done: no window, no chunk protocol.
//
// The slots are double-buffered with the records and safe for the same reason: a rank rewrites the
// slot of round r in round r + 2, after it saw every rank publish round r + 1, and a rank publishes
// round r + 1 only after it finished round r (its reads of these slots included).
#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <vector>

#include "collectives/shm_context.h"
#include "fusion/pack.h"
#include "kernels/reduce.h"

namespace fastxfer {

namespace {

// The packed size of the bucket's first elements up to `numel`, in wire bytes.
size_t wire_bytes(const Bucket& b, size_t numel) { return numel * dtype_size(b.wire_dtype); }

// From this many packed bytes the offer is written with non-temporal stores (pack_for_peers).
constexpr size_t kEagerStreamBytes = 4096;

// Room for one pointer per rank's slot, kept by the thread (a round allocates nothing).
std::vector<const void*>& slot_pointers(int n) {
  thread_local std::vector<const void*> srcs;
  srcs.resize(static_cast<size_t>(n));
  return srcs;
}

}  // namespace

void shm_eager_offer(ShmContext& c, const AllreduceJob* job, uint32_t count) {
  ShmSegment& seg = c.seg;
  const int buf = static_cast<int>(c.round & 1);
  if (count > 0) {
    const Bucket& b = *job->bucket;
    if (wire_bytes(b, b.numel) > kEagerSlotBytes) throw std::logic_error("eager bucket larger than its slot");
    const auto t0 = std::chrono::steady_clock::now();
    if (job->prescale == 1.0 && b.dtype == b.wire_dtype && b.dtype != DType::kBool &&
        wire_bytes(b, b.numel) >= kEagerStreamBytes)
      pack_for_peers(b, job->srcs, seg.eager_slot(seg.rank(), buf));
    else
      pack(b, job->srcs, seg.eager_slot(seg.rank(), buf), job->prescale, 1);
    c.stats.pack += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  *seg.eager_count(seg.rank(), buf) = count;
}

uint32_t shm_eager_agreed(const ShmContext& c) {
  const ShmSegment& seg = c.seg;
  const int buf = static_cast<int>((c.round - 1) & 1);  // the round just exchanged
  uint32_t n = *seg.eager_count(0, buf);
  for (int j = 1; j < seg.size(); ++j) n = std::min(n, *seg.eager_count(j, buf));
  return n;
}

void shm_eager_partial(ShmContext& c, const Bucket& b, size_t numel, ReduceOp op, void* partial) {
  ShmSegment& seg = c.seg;
  const int buf = static_cast<int>((c.round - 1) & 1);
  std::vector<const void*>& srcs = slot_pointers(seg.size());
  for (int j = 0; j < seg.size(); ++j) srcs[j] = seg.eager_slot(j, buf);
  const auto t0 = std::chrono::steady_clock::now();
  reduce_block(op, b.wire_dtype, srcs.data(), seg.size(), partial, numel, 1.0);
  c.stats.reduce += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void shm_eager_allreduce(ShmContext& c, const AllreduceJob& job) {
  ShmSegment& seg = c.seg;
  const Bucket& b = *job.bucket;
  const int buf = static_cast<int>((c.round - 1) & 1);
  std::vector<const void*>& srcs = slot_pointers(seg.size());
  for (int j = 0; j < seg.size(); ++j) srcs[j] = seg.eager_slot(j, buf);
  const auto t0 = std::chrono::steady_clock::now();
  if (b.tensors.size() == 1 && b.wire_dtype == b.dtype) {
    // One uncompressed tensor: reduce straight into it. This rank's part is read from its input,
    // not its slot, when the two hold the same bits (no prescale): the peers are reading the slot
    // at this moment, and sharing those lines with them was measured to cost more than the read.
    if (job.prescale == 1.0) srcs[seg.rank()] = job.srcs[0];
    reduce_block(job.op, b.wire_dtype, srcs.data(), seg.size(), job.outs[0], b.numel, job.postscale);
    c.stats.reduce += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else {
    thread_local std::vector<char> scratch;
    scratch.resize(wire_bytes(b, b.numel));
    reduce_block(job.op, b.wire_dtype, srcs.data(), seg.size(), scratch.data(), b.numel, job.postscale);
    const auto t1 = std::chrono::steady_clock::now();
    c.stats.reduce += std::chrono::duration<double>(t1 - t0).count();
    unpack(b, scratch.data(), job.outs, 1.0, 1);
    c.stats.unpack += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  }
  ++c.stats.eager;
  c.stats.bytes += wire_bytes(b, b.numel);
}

}  // namespace fastxfer
