// The C interface of engine/c_api.h over the current Engine. A reader/writer lock keeps the
// engine alive while a submission is handed to it; exceptions never cross into C.
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "engine/engine.h"
#include "engine/request_builder.h"

namespace fastxfer {

namespace {

static_assert(FX_ALLTOALL == static_cast<int>(CollectiveKind::kAlltoall) &&
                  FX_REDUCESCATTER == static_cast<int>(CollectiveKind::kReducescatter) &&
                  FX_BOOL == static_cast<int>(DType::kBool) && FX_BOOL + 1 == kNumDTypes,
              "engine/c_api.h mirrors common/request.h and common/dtype.h");

std::shared_mutex g_mu;
std::shared_ptr<Engine> g_engine;
std::map<int, std::shared_ptr<Engine>> g_sets;  // process sets this rank belongs to, by id

void copy_message(char* err, size_t errlen, const std::string& msg) {
  if (err == nullptr || errlen == 0) return;
  std::snprintf(err, errlen, "%s", msg.c_str());
}

int32_t c_submit(const fx_request* q, fx_done_fn done, void* ctx, char* err, size_t errlen) {
  try {
    if (q == nullptr || done == nullptr) throw std::invalid_argument("fx_request and done must not be null");
    if (q->kind != FX_ALLREDUCE && q->kind != FX_BROADCAST && q->kind != FX_ALLGATHER && q->kind != FX_ALLTOALL &&
        q->kind != FX_REDUCESCATTER)
      throw std::invalid_argument("unknown collective kind " + std::to_string(q->kind));
    if (q->dtype < FX_FLOAT32 || q->dtype > FX_BOOL) throw std::invalid_argument("unknown dtype " + std::to_string(q->dtype));
    if (q->op < 0 || q->op > static_cast<int32_t>(ReduceOp::kAdasum)) throw std::invalid_argument("unknown reduction op");
    if (q->nsplits < 0 || (q->nsplits > 0 && q->splits == nullptr)) throw std::invalid_argument("bad splits");
    if (q->compression < 0 || q->compression > static_cast<int32_t>(Compression::kFP16))
      throw std::invalid_argument("unknown compression");
    if (q->ndim < 0 || (q->ndim > 0 && q->shape == nullptr)) throw std::invalid_argument("bad shape");
    RequestSpec spec;
    spec.kind = static_cast<CollectiveKind>(q->kind);
    spec.name = q->name ? q->name : "";
    spec.dtype = static_cast<DType>(q->dtype);
    spec.shape.assign(q->shape, q->shape + q->ndim);
    spec.has_data = true;
    spec.op = static_cast<ReduceOp>(q->op);
    spec.compression = static_cast<Compression>(q->compression);
    spec.root = q->root;
    spec.prescale = q->prescale;
    spec.postscale = q->postscale;
    spec.bucket_cap = q->bucket_cap;
    spec.group = q->group;
    spec.in = q->in;
    spec.out = q->out;
    if (q->nsplits > 0) spec.splits.assign(q->splits, q->splits + q->nsplits);
    std::shared_lock<std::shared_mutex> lk(g_mu);
    if (!g_engine) {
      copy_message(err, errlen, "fastxfer is not initialised: call fastxfer.init() first");
      return FX_NOT_INITIALIZED;
    }
    Engine* eng = g_engine.get();
    if (q->process_set != 0) {
      auto it = g_sets.find(q->process_set);
      if (it == g_sets.end())
        throw std::invalid_argument("process set " + std::to_string(q->process_set) +
                                    " is not registered on this rank (removed, or this rank is not one of its ranks)");
      eng = it->second.get();
    }
    Request r = build_request(std::move(spec), *eng);
    r.on_done = [done, ctx](Request& req, ErrorKind kind, const std::string& msg) {
      done(ctx, static_cast<int32_t>(kind), msg.c_str(), req.gathered.data(), req.gathered.size(), req.gathered_rows,
           req.recv_splits.data(), static_cast<int32_t>(req.recv_splits.size()));
    };
    eng->submit(std::move(r), false, q->hold != 0);
    return FX_OK;
  } catch (const PeerFailure& e) {
    copy_message(err, errlen, e.what());
    return FX_PEER_FAILURE;
  } catch (const Mismatch& e) {
    copy_message(err, errlen, e.what());
    return FX_MISMATCH;
  } catch (const std::invalid_argument& e) {
    copy_message(err, errlen, e.what());
    return FX_INVALID;
  } catch (const std::exception& e) {
    copy_message(err, errlen, e.what());
    return FX_ENGINE_ERROR;
  } catch (...) {
    copy_message(err, errlen, "unknown error");
    return FX_ENGINE_ERROR;
  }
}

const fx_engine_api kApi = {FX_C_API_VERSION, sizeof(fx_engine_api), &c_submit};

}  // namespace

void set_current_engine(std::shared_ptr<Engine> eng) {
  std::shared_ptr<Engine> old;
  {
    std::unique_lock<std::shared_mutex> lk(g_mu);
    old = std::move(g_engine);
    g_engine = std::move(eng);
    if (!g_engine) g_sets.clear();  // shutdown: the process sets' engines went first
  }
  // `old` may be the last reference: destroy it (joining its thread, failing its callbacks)
  // outside the lock, which a callback's continuation may need.
}

void set_process_set_engine(int id, std::shared_ptr<Engine> eng) {
  std::shared_ptr<Engine> old;
  {
    std::unique_lock<std::shared_mutex> lk(g_mu);
    auto it = g_sets.find(id);
    if (it != g_sets.end()) {
      old = std::move(it->second);
      g_sets.erase(it);
    }
    if (eng) g_sets[id] = std::move(eng);
  }
}

const fx_engine_api* engine_c_api() { return &kApi; }

}  // namespace fastxfer
