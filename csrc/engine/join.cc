// Engine: join, for uneven batches. A rank whose next request is a join has no more data: while its
// peers still run allreduces, it stands in for each of them with the op's neutral element, so the
// peers' sums are unchanged and nobody waits for a rank that has nothing left to send. The round
// that detects joined ranks is Engine::run_round (engine.cc).
#include "engine/engine.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastxfer {

namespace {

// The element that leaves a reduction unchanged: 0 for sum/average, 1 for product, +inf (or the
// largest integer) for min, -inf (or the smallest) for max; bool: false for sum/max (or), true for
// min/product (and).
void fill_neutral(DType dt, ReduceOp op, void* p, size_t n) {
  if (op == ReduceOp::kSum || op == ReduceOp::kAverage || op == ReduceOp::kAdasum) {  // adasum(a, 0) = a
    std::memset(p, 0, n * dtype_size(dt));
    return;
  }
  auto fill = [&](auto v) {
    using T = decltype(v);
    T* q = static_cast<T*>(p);
    std::fill(q, q + n, v);
  };
  if (op == ReduceOp::kProduct) {
    switch (dt) {
      case DType::kFloat32: return fill(1.0f);
      case DType::kFloat64: return fill(1.0);
      case DType::kFloat16: return fill(static_cast<uint16_t>(0x3C00));
      case DType::kBFloat16: return fill(static_cast<uint16_t>(0x3F80));
      case DType::kInt32: return fill(int32_t{1});
      case DType::kInt64: return fill(int64_t{1});
      case DType::kUInt8: case DType::kInt8: case DType::kBool: return fill(uint8_t{1});
      case DType::kUInt16: case DType::kInt16: return fill(uint16_t{1});
    }
  }
  const bool lo = op == ReduceOp::kMax;
  auto ints = [&](auto t) {
    using T = decltype(t);
    return fill(lo ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max());
  };
  switch (dt) {
    case DType::kFloat32: return fill(lo ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity());
    case DType::kFloat64:
      return fill(lo ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity());
    case DType::kFloat16: return fill(static_cast<uint16_t>(lo ? 0xFC00 : 0x7C00));
    case DType::kBFloat16: return fill(static_cast<uint16_t>(lo ? 0xFF80 : 0x7F80));
    case DType::kInt32: return ints(int32_t{});
    case DType::kInt64: return ints(int64_t{});
    case DType::kUInt8: return ints(uint8_t{});
    case DType::kInt8: return ints(int8_t{});
    case DType::kUInt16: return ints(uint16_t{});
    case DType::kInt16: return ints(int16_t{});
    case DType::kBool: return fill(static_cast<uint8_t>(lo ? 0 : 1));
  }
  throw std::invalid_argument(std::string("join: no neutral element for ") + dtype_name(dt));
}

}  // namespace

std::vector<std::unique_ptr<Request>> Engine::stand_ins(const std::vector<Record>& recs, size_t n) {
  std::vector<std::unique_ptr<Request>> out;
  for (size_t i = 0; i < n; ++i) {
    const Record& rec = recs[i];
    auto r = std::make_unique<Request>();
    r->kind = CollectiveKind::kAllreduce;
    r->dtype = static_cast<DType>(rec.dtype);
    r->numel = record_numel(rec);
    r->op = static_cast<ReduceOp>(rec.op);
    r->compression = static_cast<Compression>(rec.compression);
    r->prescale = rec.prescale;
    r->postscale = rec.postscale;
    r->rec = rec;
    r->stand_in = true;
    const size_t bytes = r->numel * dtype_size(r->dtype);
    r->stand_in_buf.resize(2 * bytes + 1);
    fill_neutral(r->dtype, r->op, r->stand_in_buf.data(), r->numel);
    r->in = r->stand_in_buf.data();
    r->out = r->stand_in_buf.data() + bytes;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace fastxfer
