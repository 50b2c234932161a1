// RequestSpec -> Request: the average's divisor, the element count and the descriptor record that
// ranks compare, made the same way for the numpy and the TensorFlow entry.
#include "engine/request_builder.h"

#include <stdexcept>

namespace fastxfer {

Request build_request(const RequestSpec& spec, const Engine& eng) {
  Request r;
  r.kind = spec.kind;
  r.dtype = spec.dtype;
  r.op = spec.op;
  r.compression = spec.compression;
  r.root = spec.root;
  r.prescale = spec.prescale;
  r.postscale = spec.postscale;
  size_t numel = 0;
  if (spec.has_data) {
    numel = 1;
    for (int64_t d : spec.shape) {
      if (d < 0) throw std::invalid_argument("negative dimension");
      numel *= static_cast<size_t>(d);
    }
  }
  r.numel = numel;
  r.in = spec.in;
  r.out = spec.out;
  if (numel > 0 && r.in == nullptr) throw std::invalid_argument("null input buffer");
  if (numel > 0 && (r.kind == CollectiveKind::kAllreduce || r.kind == CollectiveKind::kBroadcast) &&
      r.out == nullptr)
    throw std::invalid_argument("null output buffer");
  r.splits = spec.splits;
  // Average = the sum times 1/size, folded into the postscale that unpacking applies anyway.
  if (r.op == ReduceOp::kAverage) r.postscale /= static_cast<double>(eng.size());
  r.rec = make_record(r.kind, spec.name, r.dtype, spec.shape, r.op, r.compression, r.root, r.prescale, r.postscale);
  r.rec.bucket_cap = spec.bucket_cap;
  r.group = spec.group;
  return r;
}

}  // namespace fastxfer
