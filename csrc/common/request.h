// What one collective call is: its kind, reduction op, and the fixed-size descriptor ranks
// exchange to agree on order and detect mismatches.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace fastxfer {

// The values are part of the C interface (engine/c_api.h FX_*) and of the records ranks exchange.
enum class CollectiveKind : int32_t {
  kAllreduce = 0, kBroadcast, kAllgather, kBarrier, kShutdown, kJoin, kAlltoall, kReducescatter
};
enum class ReduceOp : int32_t { kSum = 0, kAverage, kMin, kMax, kProduct, kAdasum };

// Collectives whose first dimension may differ between ranks (the rest of the shape must match).
inline bool first_dim_may_differ(CollectiveKind k) {
  return k == CollectiveKind::kAllgather || k == CollectiveKind::kAlltoall;
}

const char* kind_name(CollectiveKind k);
const char* op_name(ReduceOp op);
ReduceOp op_from_name(const std::string& name);  // throws std::invalid_argument

constexpr int kMaxDims = 8;

// Plain-old-data, written into shared memory as is; every rank compares every rank's records.
struct Record {
  uint64_t name_hash;
  char name[56];  // truncated copy for error messages
  int32_t kind;
  int32_t dtype;
  int32_t op;
  int32_t compression;
  int32_t root;
  int32_t ndim;          // -1: more than kMaxDims, compare shape_hash only
  int64_t shape[kMaxDims];
  uint64_t shape_hash;
  int64_t numel;  // product of the shape (per rank for allgather)
  double prescale;
  double postscale;
  int64_t bucket_cap;  // allreduce: fusion bucket cap in bytes (0: the engine's default)
};

// 192 bytes: docs/algorithms.md counts negotiation traffic in these; the segment stores them as is.
static_assert(sizeof(Record) == 192, "Record is exchanged as raw bytes: keep its size and layout fixed");

Record make_record(CollectiveKind kind, const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                   ReduceOp op, Compression compression, int root, double prescale, double postscale);

// Empty when `a` (from rank ra) and `b` (from rank rb) describe the same collective; otherwise a
// sentence naming both sides. allgather allows the first dimension to differ.
std::string compare_records(const Record& a, int ra, const Record& b, int rb);

std::string describe(const Record& r);

size_t record_numel(const Record& r);

}  // namespace fastxfer
