// Descriptor records: construction, comparison, and readable descriptions for error messages.
#include "common/request.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace fastxfer {

namespace {

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string shape_str(const Record& r) {
  if (r.ndim < 0) return "[>8 dims]";
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < r.ndim; ++i) s << (i ? "," : "") << r.shape[i];
  s << "]";
  return s.str();
}

// Doubles are compared by their bits: NaN == NaN here (every rank passing the same NaN agrees;
// the collective layer refuses non-finite scale factors before this), and -0.0 != 0.0.
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The shortest decimal that reads back as exactly `v`: two different values never print alike.
std::string num(double v) {
  char buf[40];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v || v != v) break;
  }
  return buf;
}

}  // namespace

const char* kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllreduce: return "allreduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllgather: return "allgather";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kShutdown: return "shutdown";
    case CollectiveKind::kJoin: return "join";
    case CollectiveKind::kAlltoall: return "alltoall";
    case CollectiveKind::kReducescatter: return "reducescatter";
  }
  return "?";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAverage: return "average";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kAdasum: return "adasum";
  }
  return "?";
}

ReduceOp op_from_name(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "average" || name == "avg" || name == "mean") return ReduceOp::kAverage;
  if (name == "min") return ReduceOp::kMin;
  if (name == "max") return ReduceOp::kMax;
  if (name == "product" || name == "prod") return ReduceOp::kProduct;
  if (name == "adasum") return ReduceOp::kAdasum;
  throw std::invalid_argument("unknown op '" + name + "': expected 'sum', 'average', 'min', 'max', 'product' or 'adasum'");
}

Record make_record(CollectiveKind kind, const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                   ReduceOp op, Compression compression, int root, double prescale, double postscale) {
  Record r;
  std::memset(&r, 0, sizeof(r));
  r.name_hash = fnv1a(name.data(), name.size());
  std::strncpy(r.name, name.c_str(), sizeof(r.name) - 1);
  r.kind = static_cast<int32_t>(kind);
  r.dtype = static_cast<int32_t>(dtype);
  r.op = static_cast<int32_t>(op);
  r.compression = static_cast<int32_t>(compression);
  r.root = root;
  r.ndim = shape.size() <= static_cast<size_t>(kMaxDims) ? static_cast<int32_t>(shape.size()) : -1;
  for (size_t i = 0; i < shape.size() && i < static_cast<size_t>(kMaxDims); ++i) r.shape[i] = shape[i];
  // allgather and alltoall may differ in the first dimension, so the hash covers the rest only
  size_t from = first_dim_may_differ(kind) && !shape.empty() ? 1 : 0;
  r.shape_hash = fnv1a(shape.data() + from, (shape.size() - from) * sizeof(int64_t), shape.size());
  r.numel = 1;
  for (int64_t d : shape) r.numel *= d;
  r.prescale = prescale;
  r.postscale = postscale;
  r.bucket_cap = 0;
  return r;
}

std::string describe(const Record& r) {
  auto kind = static_cast<CollectiveKind>(r.kind);
  std::ostringstream s;
  s << kind_name(kind);
  if (kind == CollectiveKind::kBarrier || kind == CollectiveKind::kShutdown || kind == CollectiveKind::kJoin)
    return s.str();
  s << " '" << r.name << "' " << dtype_name(static_cast<DType>(r.dtype)) << shape_str(r);
  if (kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kReducescatter) {
    s << " op=" << op_name(static_cast<ReduceOp>(r.op));
    if (r.compression) s << " compression=" << compression_name(static_cast<Compression>(r.compression));
    if (r.prescale != 1.0 || r.postscale != 1.0) s << " prescale=" << num(r.prescale) << " postscale=" << num(r.postscale);
    if (r.bucket_cap) s << " bucket_cap=" << r.bucket_cap;
  }
  if (kind == CollectiveKind::kBroadcast) s << " root=" << r.root;
  return s.str();
}

namespace {

// Everything ranks must agree on except the job-wide settings (bucket cap, scale factors).
bool same_collective(const Record& a, const Record& b) {
  bool same = a.kind == b.kind && a.name_hash == b.name_hash && a.dtype == b.dtype && a.op == b.op &&
              a.compression == b.compression && a.root == b.root && a.ndim == b.ndim && a.shape_hash == b.shape_hash;
  if (same && a.ndim > 0) {
    int from = first_dim_may_differ(static_cast<CollectiveKind>(a.kind)) ? 1 : 0;
    for (int i = from; i < a.ndim; ++i) same = same && a.shape[i] == b.shape[i];
  }
  return same;
}

}  // namespace

std::string compare_records(const Record& a, int ra, const Record& b, int rb) {
  const bool collective = same_collective(a, b);
  const bool cap = a.bucket_cap == b.bucket_cap;
  const bool scales = same_bits(a.prescale, b.prescale) && same_bits(a.postscale, b.postscale);
  if (collective && cap && scales) return {};
  std::string head = "rank " + std::to_string(ra) + " submitted " + describe(a) + " but rank " +
                     std::to_string(rb) + " submitted " + describe(b);
  // When the collective agrees but a job-wide setting does not, name that setting and both
  // values: the two descriptions alone would read almost alike.
  if (collective && !cap)
    return head + " (their fusion bucket caps differ: rank " + std::to_string(ra) + " " + std::to_string(a.bucket_cap) +
           " bytes, rank " + std::to_string(rb) + " " + std::to_string(b.bucket_cap) +
           " bytes; fx.init(bucket_cap_mb=...), FASTXFER_BUCKET_CAP_MB and bucket_cap_mb= must agree on every rank)";
  if (collective && !scales)
    return head + " (their scale factors differ: rank " + std::to_string(ra) + " prescale=" + num(a.prescale) +
           " postscale=" + num(a.postscale) + ", rank " + std::to_string(rb) + " prescale=" + num(b.prescale) +
           " postscale=" + num(b.postscale) + ")";
  return head;
}

size_t record_numel(const Record& r) { return static_cast<size_t>(r.numel); }

}  // namespace fastxfer
