// The one place a collective request is made from what a caller asked for: the numpy entry
// (bindings/engine.cc) and the TensorFlow op library (engine/c_api.cc) both describe a call as a
// RequestSpec and get their Request from build_request, so both compute the same reduction.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/request.h"
#include "engine/engine.h"

namespace fastxfer {

// What the caller asked for, already validated by the Python options (fastxfer/comm/options.py);
// build_request checks only what keeps the engine from reading or writing past a buffer.
struct RequestSpec {
  CollectiveKind kind = CollectiveKind::kBarrier;
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;  // empty with in == nullptr: a collective without data (barrier, join)
  bool has_data = false;
  ReduceOp op = ReduceOp::kSum;
  Compression compression = Compression::kNone;
  int root = 0;                 // broadcast: the root's position in the engine's ranks
  double prescale = 1.0;
  double postscale = 1.0;       // as the caller gave it: an average's 1/size is applied here
  int64_t bucket_cap = 0;       // bytes; 0: the engine's default
  int64_t group = 0;            // allreduce: fusion group (0: none); see Request::group
  const void* in = nullptr;
  void* out = nullptr;
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank (empty: an equal split)
};

// The request `eng` runs for `spec`. An average's postscale is multiplied by 1/eng.size() here,
// when the request is made, for every entry alike: a TensorFlow graph traced before an elastic job
// changed size, or a process set's engine, divides by the size of the engine that runs it.
// Throws std::invalid_argument for a spec that would make the engine touch memory it was not given.
// (`spec` is only read: a caller may keep one and refill it for each call, reusing its storage.)
Request build_request(const RequestSpec& spec, const Engine& eng);

}  // namespace fastxfer
