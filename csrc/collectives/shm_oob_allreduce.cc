// Out-of-band allreduce for small tensors (metrics, flags): each rank writes its record and data
// into its own slot, and every rank reduces all slots itself, in rank order. It never touches the
// window, so it never waits behind a gradient bucket.
#include <cstring>
#include <stdexcept>
#include <string>

#include "collectives/shm_context.h"
#include "common/errors.h"
#include "kernels/reduce.h"

namespace fastxfer {

void shm_oob_allreduce(ShmContext& c, const Record& rec, const void* in, void* out, size_t n, DType dtype,
                       ReduceOp op, double postscale) {
  ShmSegment& seg = c.seg;
  const size_t nbytes = n * dtype_size(dtype);
  if (nbytes > shm_oob_capacity(c))
    throw std::invalid_argument("oob_allreduce takes at most " + std::to_string(shm_oob_capacity(c)) +
                                " bytes; use allreduce for larger tensors");
  const uint32_t s = static_cast<uint32_t>(c.oob_seq);
  const int me = seg.rank();
  // 1. My single slot is free once every rank has finished the previous out-of-band reduction.
  if (c.oob_seq >= 1) seg.wait_all(Phase::kOobConsumed, s, "oob_allreduce (slot reuse)");
  // 2. Publish my record and data.
  std::memcpy(seg.oob_slot(me), &rec, sizeof(Record));
  std::memcpy(seg.oob_slot(me) + sizeof(Record), in, nbytes);
  seg.publish(Phase::kOobReady, s + 1);
  seg.wait_all(Phase::kOobReady, s + 1, "oob_allreduce");
  // 3. Every rank checks every record, so a disagreement is a Mismatch everywhere.
  for (int j = 0; j < seg.size(); ++j) {
    Record theirs;
    std::memcpy(&theirs, seg.oob_slot(j), sizeof(Record));
    std::string diff = compare_records(theirs, j, rec, me);
    if (!diff.empty()) {
      Record first;
      std::memcpy(&first, seg.oob_slot(0), sizeof(Record));
      // report the same pair on every rank: the first rank that differs from rank 0
      for (int k = 1; k < seg.size(); ++k) {
        Record other;
        std::memcpy(&other, seg.oob_slot(k), sizeof(Record));
        std::string d = compare_records(first, 0, other, k);
        if (!d.empty()) throw Mismatch("oob_allreduce: " + d);
      }
      throw Mismatch("oob_allreduce: " + diff);
    }
  }
  // 4. Reduce all slots in rank order: identical results everywhere, no second round trip.
  std::vector<const void*> srcs(seg.size());
  for (int j = 0; j < seg.size(); ++j) srcs[j] = seg.oob_slot(j) + sizeof(Record);
  reduce_block(op, dtype, srcs.data(), seg.size(), out, n, postscale);
  seg.publish(Phase::kOobConsumed, s + 1);
  ++c.oob_seq;
}

}  // namespace fastxfer
