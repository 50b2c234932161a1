// Engine: what each kind of collective does once the ranks have agreed to run it (run_batch: a run
// of consecutive allreduces fused into buckets, then broadcast, allgather, alltoall, reducescatter,
// and the kinds whose agreement is all they do), the per-kind rules checked at submit, and the
// timeline spans of each request. The thread, the queue and the rounds are engine.cc.
#include "engine/engine.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/adasum.h"
#include "fusion/bucket_planner.h"
#include "kernels/reduce.h"

namespace fastxfer {

// What alltoall and reducescatter rely on, for every entry point (numpy, the TensorFlow ops):
// a first dimension, and for alltoall splits that add up to it (default: an equal split).
void Engine::check_shape(Request& req) const {
  const auto kind = req.kind;
  if (kind != CollectiveKind::kAlltoall && kind != CollectiveKind::kReducescatter) return;
  const char* what = kind_name(kind);
  if (req.rec.ndim < 1)
    throw std::invalid_argument(std::string(what) + " needs a tensor of 1 to " + std::to_string(kMaxDims) +
                                " dimensions (it splits the first one)");
  if (kind == CollectiveKind::kReducescatter) {
    if (req.op != ReduceOp::kSum && req.op != ReduceOp::kAverage)
      throw std::invalid_argument(std::string("reducescatter takes op sum or average, not ") + op_name(req.op));
    if (req.compression != Compression::kNone) throw std::invalid_argument("reducescatter takes no compression");
    return;
  }
  const int64_t rows = req.rec.shape[0];
  const int n = size();
  if (req.splits.empty()) {
    if (rows % n != 0)
      throw std::invalid_argument("alltoall without splits sends the same number of rows to every rank: the first "
                                  "dimension (" + std::to_string(rows) + ") must be divisible by the number of ranks (" +
                                  std::to_string(n) + "); pass splits");
    req.splits.assign(n, rows / n);
    return;
  }
  if (req.splits.size() != static_cast<size_t>(n))
    throw std::invalid_argument("alltoall splits must have one entry per rank (" + std::to_string(n) + "), not " +
                                std::to_string(req.splits.size()));
  int64_t total = 0;
  for (int64_t v : req.splits) {
    if (v < 0) throw std::invalid_argument("alltoall splits must be >= 0, not " + std::to_string(v));
    total += v;
  }
  if (total != rows)
    throw std::invalid_argument("alltoall splits add up to " + std::to_string(total) +
                                " rows, but the tensor's first dimension is " + std::to_string(rows));
}

namespace {

// Whether allreduce `a` may share a bucket with allreduce `r` (the same reduction of the same dtype).
bool fusable(const Request* a, const Request* r) {
  return a->kind == CollectiveKind::kAllreduce && a->dtype == r->dtype && a->op == r->op &&
         a->compression == r->compression && a->prescale == r->prescale && a->postscale == r->postscale &&
         a->rec.bucket_cap == r->rec.bucket_cap && a->group == r->group;
}

}  // namespace

// Decided from the requests alone, so ranks that queued the same requests offer the same prefix
// (and ranks that queued more offer at least as much of the common part): the first requests that
// would fuse into one bucket, while that bucket's packed bytes stay within the limit and the cap.
size_t Engine::eager_prefix(const std::vector<Request*>& offered, size_t* bytes) const {
  const size_t limit = std::min(cfg_.eager_bytes, comm_->eager_capacity());
  if (limit == 0 || offered.empty()) return 0;
  const Request* r = offered[0];
  if (r->kind != CollectiveKind::kAllreduce || r->op == ReduceOp::kAdasum || r->stand_in) return 0;
  const size_t cap = std::min(limit, r->rec.bucket_cap > 0 ? static_cast<size_t>(r->rec.bucket_cap)
                                                            : cfg_.bucket_cap_bytes);
  const size_t es = dtype_size(wire_dtype(r->dtype, r->compression));
  const size_t align = kBucketAlignBytes / es;
  size_t numel = 0, n = 0;
  for (const Request* a : offered) {
    if (!fusable(a, r)) break;
    const size_t end = (numel + align - 1) / align * align + a->numel;  // BucketPlanner's layout
    if (end * es > cap) break;
    numel = end;
    ++n;
  }
  if (bytes != nullptr) *bytes = numel * es;
  return n;
}

void Engine::eager_job(const std::vector<Request*>& reqs, size_t n, Bucket& bucket, AllreduceJob& job) const {
  // BucketPlanner's layout of one bucket (tensors back to back from 64-byte boundaries), built
  // here without planning: this runs in every round, for calls that cost microseconds.
  const Request* r = reqs[0];
  bucket.dtype = r->dtype;
  bucket.compression = r->dtype == DType::kFloat32 ? r->compression : Compression::kNone;
  bucket.wire_dtype = wire_dtype(r->dtype, r->compression);
  const size_t align = kBucketAlignBytes / dtype_size(bucket.wire_dtype);
  bucket.numel = 0;
  bucket.tensors.clear();
  bucket.offsets.clear();
  bucket.numels.clear();
  for (size_t k = 0; k < n; ++k) {
    const size_t offset = (bucket.numel + align - 1) / align * align;
    bucket.tensors.push_back(static_cast<int>(k));
    bucket.offsets.push_back(offset);
    bucket.numels.push_back(reqs[k]->numel);
    bucket.numel = offset + reqs[k]->numel;
  }
  job.bucket = &bucket;
  job.op = r->op;
  job.prescale = r->prescale;
  job.postscale = r->postscale;
  job.srcs.clear();
  job.outs.clear();
  for (size_t k = 0; k < n; ++k) {
    job.srcs.push_back(reqs[k]->in);
    job.outs.push_back(reqs[k]->out);
  }
}

void Engine::run_eager(const std::vector<Request*>& batch, size_t n, Bucket& b, AllreduceJob& job) {
  // A prefix of the offered bucket is laid out as that bucket's first n tensors: cut it there.
  if (n > b.tensors.size()) throw std::logic_error("the one-exchange path ran more requests than it offered");
  b.tensors.resize(n);
  b.offsets.resize(n);
  b.numels.resize(n);
  b.numel = b.offsets[n - 1] + b.numels[n - 1];
  job.srcs.resize(n);
  job.outs.resize(n);
  const double t0 = timeline_.enabled() ? timeline_.now() : 0;
  comm_->eager_allreduce(job);
  if (timeline_.enabled()) {
    const double t1 = timeline_.now();
    const std::string label = "bucket " + std::to_string(buckets_++);
    timeline_.span(Timeline::kEngineLane, "engine", label, t0, t1,
                   "\"tensors\": " + std::to_string(n) + ", \"bytes\": " + std::to_string(b.nbytes()) +
                       ", \"wire\": \"" + dtype_name(b.wire_dtype) + "\", \"path\": \"with the records\"");
    for (size_t k = 0; k < n; ++k) trace(*batch[k], t0, t1, label);
  }
  for (size_t k = 0; k < n; ++k) finish(batch[k]);
}

// A request must not be touched after finish(r): its waiter may release it at once.
void Engine::run_batch(const std::vector<Request*>& batch, const std::vector<std::vector<Record>>& all,
                       size_t start) {
  for (size_t i = start; i < batch.size();) {
    Request* r = batch[i];
    switch (r->kind) {
      case CollectiveKind::kAllreduce: {
        // Fuse the run of consecutive allreduces that can share a bucket.
        size_t e = i + 1;
        while (e < batch.size() && fusable(batch[e], r)) ++e;
        // `r` is finished with the first bucket (and may be released): keep what the run needs.
        const ReduceOp op = r->op;
        const double prescale = r->prescale, postscale = r->postscale;
        // Planned into the round's storage, kept between rounds: a warm run of the same shapes
        // allocates nothing (the tuner may send a single small bucket here every round).
        std::vector<TensorSpec>& specs = round_.specs;
        specs.clear();
        for (size_t k = i; k < e; ++k) specs.push_back({batch[k]->numel, batch[k]->dtype});
        const size_t cap = r->rec.bucket_cap > 0 ? static_cast<size_t>(r->rec.bucket_cap) : cfg_.bucket_cap_bytes;
        BucketPlanner(cap, cap, r->compression).plan_into(specs, round_.plan);
        AllreduceJob& job = round_.run;
        job.op = op;
        job.prescale = prescale;
        job.postscale = postscale;
        for (const Bucket& b : round_.plan) {
          job.bucket = &b;
          job.srcs.clear();
          job.outs.clear();
          for (int t : b.tensors) {
            job.srcs.push_back(batch[i + t]->in);
            job.outs.push_back(batch[i + t]->out);
          }
          const double t0 = timeline_.enabled() ? timeline_.now() : 0;
          if (op == ReduceOp::kAdasum)
            adasum_allreduce(*comm_, job, 1);
          else
            comm_->allreduce(job);
          if (timeline_.enabled()) {
            const double t1 = timeline_.now();
            const std::string label = "bucket " + std::to_string(buckets_++);
            timeline_.span(Timeline::kEngineLane, "engine", label, t0, t1,
                           "\"tensors\": " + std::to_string(b.tensors.size()) + ", \"bytes\": " +
                               std::to_string(b.nbytes()) + ", \"wire\": \"" + dtype_name(b.wire_dtype) + "\"");
            for (int t : b.tensors) trace(*batch[i + t], t0, t1, label);
          }
          for (int t : b.tensors) finish(batch[i + t]);
        }
        i = e;
        continue;
      }
      case CollectiveKind::kBroadcast: {
        const double t0 = timeline_.enabled() ? timeline_.now() : 0;
        comm_->broadcast(r->in, r->out, r->numel * dtype_size(r->dtype), r->root);
        if (timeline_.enabled()) trace(*r, t0, timeline_.now(), "broadcast");
        break;
      }
      case CollectiveKind::kAllgather: {
        std::vector<size_t> bytes(all.size());
        size_t total = 0;
        int64_t rows = 0;
        for (size_t j = 0; j < all.size(); ++j) {
          bytes[j] = record_numel(all[j][i]) * dtype_size(r->dtype);
          total += bytes[j];
          rows += all[j][i].ndim > 0 ? all[j][i].shape[0] : 1;
        }
        r->gathered.resize(total);
        r->gathered_rows = rows;
        const double t0 = timeline_.enabled() ? timeline_.now() : 0;
        comm_->allgather(r->in, r->gathered.data(), bytes);
        if (timeline_.enabled()) trace(*r, t0, timeline_.now(), "allgather");
        break;
      }
      case CollectiveKind::kAlltoall: {
        // Every rank's splits first (size x size rows), then the blocks themselves.
        const size_t n = all.size();
        const int me = comm_->rank();
        int64_t row = 1;  // elements per row: the rest of the shape, the same on every rank
        for (int d = 1; d < r->rec.ndim; ++d) row *= r->rec.shape[d];
        const size_t row_bytes = static_cast<size_t>(row) * dtype_size(r->dtype);
        std::vector<int64_t> matrix(n * n);
        const double t0 = timeline_.enabled() ? timeline_.now() : 0;
        comm_->allgather(r->splits.data(), matrix.data(), std::vector<size_t>(n, n * sizeof(int64_t)));
        std::vector<size_t> bytes(n * n);
        for (size_t k = 0; k < n * n; ++k) bytes[k] = static_cast<size_t>(matrix[k]) * row_bytes;
        r->recv_splits.resize(n);
        int64_t rows = 0;
        for (size_t j = 0; j < n; ++j) rows += (r->recv_splits[j] = matrix[j * n + me]);
        r->gathered.resize(static_cast<size_t>(rows) * row_bytes);
        r->gathered_rows = rows;
        comm_->alltoall(r->in, r->gathered.data(), bytes);
        if (timeline_.enabled()) trace(*r, t0, timeline_.now(), "alltoall");
        break;
      }
      case CollectiveKind::kReducescatter: {
        // Rows split as evenly as possible, the first (rows mod size) ranks one more (Horovod's rule).
        const int64_t n = static_cast<int64_t>(all.size()), rows = r->rec.shape[0];
        const int me = comm_->rank();
        const size_t row = rows > 0 ? r->numel / static_cast<size_t>(rows) : 0;
        // Pre-scaled as Horovod does, each rank's input before the reduction (integers truncate
        // there, not after the sum), into a copy: the input tensor is the caller's.
        std::vector<char> prescaled;
        const void* in = r->in;
        if (r->prescale != 1.0) {
          prescaled.resize(r->numel * dtype_size(r->dtype));
          reduce_block(ReduceOp::kSum, r->dtype, &in, 1, prescaled.data(), r->numel, r->prescale);
          in = prescaled.data();
        }
        ReducescatterJob job{in, r->out, r->dtype, r->op, r->postscale, {}};
        for (int64_t j = 0; j < n; ++j) job.counts.push_back(static_cast<size_t>(rows / n + (j < rows % n)) * row);
        r->gathered_rows = rows / n + (me < rows % n);
        if (job.out == nullptr) {
          r->gathered.resize(job.counts[me] * dtype_size(r->dtype));
          job.out = r->gathered.data();
        }
        const double t0 = timeline_.enabled() ? timeline_.now() : 0;
        comm_->reducescatter(job);
        if (timeline_.enabled()) trace(*r, t0, timeline_.now(), "reducescatter");
        break;
      }
      case CollectiveKind::kJoin:      // every rank has joined: agreeing on it completes it
      case CollectiveKind::kBarrier:   // agreeing on it was the barrier: every rank had reached it
      case CollectiveKind::kShutdown:  // likewise; the loop stops after this batch
        break;
    }
    finish(r);
    ++i;
  }
}

void Engine::trace(const Request& r, double t0, double t1, const std::string& bucket) {
  const int lane = timeline_.lane(std::string(r.rec.name, strnlen(r.rec.name, sizeof r.rec.name)));
  // a request submitted or agreed before the timeline started has no times of its own
  const double agreed = r.t_agreed > 0 ? r.t_agreed : t0;
  if (r.t_submit > 0) timeline_.span(lane, "tensor", "queued", r.t_submit, agreed);
  if (t0 > agreed) timeline_.span(lane, "tensor", "wait", agreed, t0);
  timeline_.span(lane, "tensor", kind_name(r.kind), t0, t1,
                 "\"bucket\": \"" + bucket + "\", \"elements\": " + std::to_string(r.numel) + ", \"dtype\": \"" +
                     dtype_name(r.dtype) + "\"");
}

}  // namespace fastxfer
