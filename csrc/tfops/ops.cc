// fastxfer's TensorFlow ops: native, asynchronous collectives with no Python and no GIL per tensor.
//
// A collective is two ops, so that a traced function can fix the order in which ranks issue
// them (control edges between submits, fastxfer/tensorflow/ops.py) without serialising the
// reductions themselves:
//
//   FastxferSubmit(tensor) -> (output, handle)   synchronous, returns at once
//       Hands the tensor to the engine. For allreduce/broadcast, `output` is the tensor's own
//       buffer when TensorFlow lets the input be forwarded (nobody else holds it), so the engine
//       reduces in place; otherwise a new buffer, which the engine writes the result to. For
//       allgather, `output` is the input (kept alive for the engine).
//   FastxferWait(output, handle) -> result        asynchronous
//   FastxferWaitGather(output, handle) -> result  asynchronous (allgather, reducescatter: result
//                                                 allocated here, its first dimension known now)
//       Completes when the engine has finished that collective; `result` shares `output`'s
//       buffer. TensorFlow's executor goes on with other work meanwhile.
//   FastxferSubmitSplits(tensor, splits) -> (output, handle)          alltoall (splits: a tensor,
//   FastxferWaitAlltoall(output, handle) -> (result, received_splits)  known only when it runs)
//
// Between the two, `output` must be read by nobody but the wait op (ops.py guarantees it: the
// tensor is only ever wired into its wait). The op library holds a reference to every buffer the
// engine may still touch until the engine says it is done, so a step that is abandoned between
// submit and wait cannot free memory under the engine.
//
// The engine is reached through its C interface (engine/c_api.h), which fastxfer._core hands
// over after loading this library (fastxfer_tfops_connect).
//
// One thing the C API leaves out: the TF_AsyncOpKernelDoneCallback* handed to an asynchronous
// kernel is the address of TensorFlow's own std::function<void()> argument, valid only until
// the kernel's compute function returns (TF_RunAsyncOpKernelDoneCallback just calls it). A
// kernel that completes later must keep a copy: `keep_done` copy-constructs that std::function
// (libstdc++'s copy calls the manager TensorFlow compiled, so it clones TensorFlow's callback
// correctly). This relies on TensorFlow building against libstdc++, as every Linux wheel does;
// docs/tensorflow.md records it, and FASTXFER_TF_NATIVE=0 turns the native ops off.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/c_api.h"
#include "tfops/tf_c.h"

namespace fastxfer {
namespace tfops {

namespace {

std::atomic<const fx_engine_api*> g_api{nullptr};
std::string g_load_error;  // why the ops could not be registered ("" when they were)

// A collective between its submit and its wait.
struct Pending {
  int32_t kind = FX_ALLREDUCE;
  bool done = false;
  int32_t error = FX_OK;
  std::string message;
  std::vector<char> gathered;
  int64_t rows = 0;
  std::vector<int32_t> recv_splits;  // alltoall
  TF_Tensor* keep_in = nullptr;   // buffers the engine may still read or write
  TF_Tensor* keep_out = nullptr;
  TF_OpKernelContext* wait_ctx = nullptr;  // the wait op, once it has run
  TF_AsyncOpKernelDoneCallback* wait_done = nullptr;  // owned copy (keep_done) when deferred
  bool wait_done_owned = false;
  int wait_dtype = 0;
  std::vector<int64_t> wait_dims;  // allgather: the input's shape (rows replaced by the total)
};

std::mutex g_mu;
std::unordered_map<int64_t, Pending> g_pending;
std::atomic<int64_t> g_next_handle{1};
std::atomic<int64_t> g_forwarded{0}, g_allocated{0};
std::atomic<int64_t> g_submitted{0};  // requests handed to the engine
std::atomic<int64_t> g_allocated_bytes{0};  // allreduce/broadcast submits: in place or not

// RAII TF_Status.
struct Status {
  TF_Status* s;
  Status() : s(tf.TF_NewStatus()) {}
  ~Status() { tf.TF_DeleteStatus(s); }
  bool ok() const { return tf.TF_GetCode(s) == kTfOk; }
  Status(const Status&) = delete;
  Status& operator=(const Status&) = delete;
};

// The Python class each engine error belongs to leads the message, so that fastxfer.tensorflow
// can raise fastxfer's own exceptions (and users can read what happened inside model.fit).
void fail(TF_OpKernelContext* ctx, int32_t error, const std::string& msg) {
  int code = kTfInternal;
  const char* cls = "FastxferError";
  switch (error) {
    case FX_PEER_FAILURE: code = kTfAborted; cls = "PeerFailureError"; break;
    case FX_MISMATCH: code = kTfFailedPrecondition; cls = "MismatchError"; break;
    case FX_INVALID: code = kTfInvalidArgument; cls = "ValueError"; break;
    case FX_NOT_INITIALIZED: code = kTfFailedPrecondition; break;
    default: break;
  }
  Status st;
  tf.TF_SetStatus(st.s, code, (std::string(cls) + ": " + msg).c_str());
  tf.TF_OpKernelContext_Failure(ctx, st.s);
}

int32_t fx_dtype(int tf_type) {
  switch (tf_type) {
    case kTfFloat: return FX_FLOAT32;
    case kTfDouble: return FX_FLOAT64;
    case kTfHalf: return FX_FLOAT16;
    case kTfBFloat16: return FX_BFLOAT16;
    case kTfInt32: return FX_INT32;
    case kTfInt64: return FX_INT64;
    case kTfUInt8: return FX_UINT8;
    case kTfInt8: return FX_INT8;
    case kTfUInt16: return FX_UINT16;
    case kTfInt16: return FX_INT16;
    case kTfBool: return FX_BOOL;
    default: return -1;
  }
}

std::vector<int64_t> dims_of(const TF_Tensor* t) {
  std::vector<int64_t> d(tf.TF_NumDims(t));
  for (int i = 0; i < static_cast<int>(d.size()); ++i) d[i] = tf.TF_Dim(t, i);
  return d;
}

// ------------------------------------------------------------------------------------------
// Completing a wait.

using DoneFunction = std::function<void()>;
static_assert(sizeof(DoneFunction) == 32, "libstdc++'s std::function layout, as TensorFlow's C API passes it");

TF_AsyncOpKernelDoneCallback* keep_done(TF_AsyncOpKernelDoneCallback* done) {
  return reinterpret_cast<TF_AsyncOpKernelDoneCallback*>(new DoneFunction(*reinterpret_cast<DoneFunction*>(done)));
}

// Collectives whose result the wait op allocates (its first dimension is known only at the end).
bool gathers(int32_t kind) { return kind == FX_ALLGATHER || kind == FX_REDUCESCATTER || kind == FX_ALLTOALL; }

// Runs the wait op's continuation for a finished collective (its entry already removed).
void complete_wait(Pending& p) {
  TF_OpKernelContext* ctx = p.wait_ctx;
  if (p.error == FX_OK && p.kind == FX_ALLTOALL) {
    const int64_t n = static_cast<int64_t>(p.recv_splits.size());
    Status st;
    TF_Tensor* sp = tf.TF_AllocateOutput(ctx, 1, kTfInt32, &n, 1, p.recv_splits.size() * sizeof(int32_t), st.s);
    if (!st.ok()) {
      p.error = FX_ENGINE_ERROR;
      p.message = std::string("allocating the received splits: ") + tf.TF_Message(st.s);
    } else {
      if (n) std::memcpy(tf.TF_TensorData(sp), p.recv_splits.data(), p.recv_splits.size() * sizeof(int32_t));
      tf.TF_DeleteTensor(sp);
    }
  }
  if (p.error != FX_OK) {
    fail(ctx, p.error, p.message);
  } else if (gathers(p.kind)) {
    std::vector<int64_t> dims = p.wait_dims;
    if (dims.empty()) dims.push_back(0);
    dims[0] = p.rows;
    Status st;
    TF_Tensor* out = tf.TF_AllocateOutput(ctx, 0, p.wait_dtype, dims.data(), static_cast<int>(dims.size()),
                                          p.gathered.size(), st.s);
    if (!st.ok()) {
      tf.TF_OpKernelContext_Failure(ctx, st.s);
    } else {
      if (!p.gathered.empty()) std::memcpy(tf.TF_TensorData(out), p.gathered.data(), p.gathered.size());
      tf.TF_DeleteTensor(out);
    }
  }
  tf.TF_RunAsyncOpKernelDoneCallback(p.wait_done);
  if (p.wait_done_owned) delete reinterpret_cast<DoneFunction*>(p.wait_done);
}

// The engine's completion callback (engine thread).
void on_engine_done(void* ctx, int32_t error, const char* message, const void* gathered, size_t gathered_bytes,
                    int64_t rows, const int64_t* recv_splits, int32_t nsplits) {
  const int64_t handle = reinterpret_cast<intptr_t>(ctx);
  Pending finished;
  bool waiting = false;
  TF_Tensor *keep_in = nullptr, *keep_out = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_pending.find(handle);
    if (it == g_pending.end()) return;  // cannot happen: entries live until both sides are done
    Pending& p = it->second;
    p.done = true;
    p.error = error;
    if (error != FX_OK) p.message = message ? message : "";
    if (error == FX_OK && gathers(p.kind)) {
      p.gathered.assign(static_cast<const char*>(gathered), static_cast<const char*>(gathered) + gathered_bytes);
      p.rows = rows;
      p.recv_splits.assign(recv_splits, recv_splits + nsplits);
    }
    keep_in = p.keep_in;
    keep_out = p.keep_out;
    p.keep_in = p.keep_out = nullptr;
    if (p.wait_done != nullptr) {
      waiting = true;
      finished = std::move(p);
      g_pending.erase(it);
    }
  }
  if (keep_in) tf.TF_DeleteTensor(keep_in);
  if (keep_out) tf.TF_DeleteTensor(keep_out);
  if (waiting) complete_wait(finished);
}

// ------------------------------------------------------------------------------------------
// FastxferSubmit

struct SubmitAttrs {
  int32_t kind = FX_ALLREDUCE;
  std::string name;
  int64_t op = 0, compression = 0, root = 0, bucket_cap = 0, process_set = 0, hold = 0, group = 0;
  double prescale = 1.0, postscale = 1.0;
  int dtype = 0;
};

std::string get_string_attr(TF_OpKernelConstruction* c, const char* attr, TF_Status* s) {
  int32_t list_size = 0, total = 0;
  tf.TF_OpKernelConstruction_GetAttrSize(c, attr, &list_size, &total, s);
  if (tf.TF_GetCode(s) != kTfOk) return "";
  std::string v(static_cast<size_t>(total), '\0');
  tf.TF_OpKernelConstruction_GetAttrString(c, attr, v.data(), v.size(), s);
  return v;
}

double bits_to_double(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

void* submit_create(TF_OpKernelConstruction* c) {
  auto* a = new SubmitAttrs;
  Status st;
  std::string kind = get_string_attr(c, "kind", st.s);
  if (st.ok()) a->name = get_string_attr(c, "tensor_name", st.s);
  int64_t pre = 0, post = 0;
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "reduce_op", &a->op, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "compression", &a->compression, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "root", &a->root, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "bucket_cap", &a->bucket_cap, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "process_set", &a->process_set, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "hold", &a->hold, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "group", &a->group, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "prescale_bits", &pre, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrInt64(c, "postscale_bits", &post, st.s);
  if (st.ok()) tf.TF_OpKernelConstruction_GetAttrType(c, "T", &a->dtype, st.s);
  if (st.ok()) {
    a->prescale = bits_to_double(pre);
    a->postscale = bits_to_double(post);
    a->kind = kind == "broadcast"       ? FX_BROADCAST
              : kind == "allgather"     ? FX_ALLGATHER
              : kind == "alltoall"      ? FX_ALLTOALL
              : kind == "reducescatter" ? FX_REDUCESCATTER
                                        : FX_ALLREDUCE;
  } else {
    tf.TF_OpKernelConstruction_Failure(c, st.s);
  }
  return a;
}

void submit_delete(void* p) { delete static_cast<SubmitAttrs*>(p); }

void submit_compute(void* kernel, TF_OpKernelContext* ctx) {
  const SubmitAttrs& a = *static_cast<SubmitAttrs*>(kernel);
  const fx_engine_api* api = g_api.load(std::memory_order_acquire);
  if (api == nullptr) {
    fail(ctx, FX_NOT_INITIALIZED, "fastxfer's TensorFlow ops are not connected to an engine: call fastxfer.init() first");
    return;
  }
  Status st;
  TF_Tensor* in = nullptr;
  tf.TF_GetInput(ctx, 0, &in, st.s);
  if (!st.ok()) return tf.TF_OpKernelContext_Failure(ctx, st.s);
  std::vector<int64_t> dims = dims_of(in);
  Pending p;
  p.kind = a.kind;
  const void* src = nullptr;
  void* dst = nullptr;
  std::vector<int64_t> splits;  // alltoall: the second input (int32 or int64)
  if (a.kind == FX_ALLTOALL) {
    TF_Tensor* sp = nullptr;
    tf.TF_GetInput(ctx, 1, &sp, st.s);
    if (!st.ok()) {
      tf.TF_DeleteTensor(in);
      return tf.TF_OpKernelContext_Failure(ctx, st.s);
    }
    const int64_t n = tf.TF_NumDims(sp) == 0 ? 1 : tf.TF_Dim(sp, 0);
    if (tf.TF_TensorType(sp) == kTfInt32) {
      const int32_t* v = static_cast<const int32_t*>(tf.TF_TensorData(sp));
      splits.assign(v, v + n);
    } else {
      const int64_t* v = static_cast<const int64_t*>(tf.TF_TensorData(sp));
      splits.assign(v, v + n);
    }
    tf.TF_DeleteTensor(sp);
  }
  if (gathers(a.kind)) {
    tf.TF_SetOutput(ctx, 0, in, st.s);
    if (!st.ok()) {
      tf.TF_DeleteTensor(in);
      return tf.TF_OpKernelContext_Failure(ctx, st.s);
    }
    src = tf.TF_TensorData(in);
    p.keep_in = in;
  } else {
    // Drop our reference before asking: a second reference would stop TensorFlow forwarding it.
    tf.TF_DeleteTensor(in);
    const int candidates[1] = {0};
    int forwarded = -1;
    TF_Tensor* out = tf.TF_ForwardInputOrAllocateOutput(ctx, candidates, 1, 0, dims.data(),
                                                        static_cast<int>(dims.size()), &forwarded, st.s);
    if (!st.ok()) return tf.TF_OpKernelContext_Failure(ctx, st.s);
    p.keep_out = out;
    dst = tf.TF_TensorData(out);
    if (forwarded == 0) {
      src = dst;  // in place: the gradient's own buffer
      g_forwarded.fetch_add(1, std::memory_order_relaxed);
    } else {
      g_allocated.fetch_add(1, std::memory_order_relaxed);
      g_allocated_bytes.fetch_add(static_cast<int64_t>(tf.TF_TensorByteSize(out)), std::memory_order_relaxed);
      tf.TF_GetInput(ctx, 0, &in, st.s);
      if (!st.ok()) {
        tf.TF_DeleteTensor(out);
        return tf.TF_OpKernelContext_Failure(ctx, st.s);
      }
      p.keep_in = in;
      src = tf.TF_TensorData(in);
    }
  }
  const int64_t handle = g_next_handle.fetch_add(1);
  TF_Tensor* h = tf.TF_AllocateOutput(ctx, 1, kTfInt64, nullptr, 0, sizeof(int64_t), st.s);
  if (!st.ok()) {
    if (p.keep_in) tf.TF_DeleteTensor(p.keep_in);
    if (p.keep_out) tf.TF_DeleteTensor(p.keep_out);
    return tf.TF_OpKernelContext_Failure(ctx, st.s);
  }
  *static_cast<int64_t*>(tf.TF_TensorData(h)) = handle;
  tf.TF_DeleteTensor(h);

  fx_request q{};
  q.kind = a.kind;
  q.dtype = fx_dtype(a.dtype);
  q.name = a.name.c_str();
  q.shape = dims.data();
  q.ndim = static_cast<int32_t>(dims.size());
  q.op = static_cast<int32_t>(a.op);
  q.compression = static_cast<int32_t>(a.compression);
  q.root = static_cast<int32_t>(a.root);
  q.prescale = a.prescale;
  q.postscale = a.postscale;
  q.bucket_cap = a.bucket_cap;
  q.in = src;
  q.out = dst;
  q.splits = splits.empty() ? nullptr : splits.data();
  q.nsplits = static_cast<int32_t>(splits.size());
  q.process_set = static_cast<int32_t>(a.process_set);
  q.hold = a.hold != 0 ? 1 : 0;
  q.group = a.group;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_pending.emplace(handle, std::move(p));  // before submitting: the engine may finish at once
  }
  char err[2048];
  err[0] = '\0';
  int32_t rc = api->submit(&q, on_engine_done, reinterpret_cast<void*>(static_cast<intptr_t>(handle)), err, sizeof err);
  if (rc == FX_OK) g_submitted.fetch_add(1, std::memory_order_relaxed);
  if (rc != FX_OK) {
    Pending refused;
    {
      std::lock_guard<std::mutex> lk(g_mu);
      auto it = g_pending.find(handle);
      refused = std::move(it->second);
      g_pending.erase(it);
    }
    if (refused.keep_in) tf.TF_DeleteTensor(refused.keep_in);
    if (refused.keep_out) tf.TF_DeleteTensor(refused.keep_out);
    fail(ctx, rc, err);
  }
}

// ------------------------------------------------------------------------------------------
// FastxferWait / FastxferWaitGather

struct WaitKernel {
  bool gather = false;  // the result is allocated at the end (allgather, reducescatter, alltoall)
  int dtype = 0;
};

void* wait_create(TF_OpKernelConstruction* c) {
  auto* k = new WaitKernel;
  Status st;
  tf.TF_OpKernelConstruction_GetAttrType(c, "T", &k->dtype, st.s);
  if (!st.ok()) tf.TF_OpKernelConstruction_Failure(c, st.s);
  return k;
}

void* wait_gather_create(TF_OpKernelConstruction* c) {
  auto* k = static_cast<WaitKernel*>(wait_create(c));
  k->gather = true;
  return k;
}

void wait_delete(void* p) { delete static_cast<WaitKernel*>(p); }

void wait_compute(void* kernel, TF_OpKernelContext* ctx, TF_AsyncOpKernelDoneCallback* done) {
  const WaitKernel& k = *static_cast<WaitKernel*>(kernel);
  Status st;
  TF_Tensor* h = nullptr;
  tf.TF_GetInput(ctx, 1, &h, st.s);
  if (!st.ok()) {
    tf.TF_OpKernelContext_Failure(ctx, st.s);
    return tf.TF_RunAsyncOpKernelDoneCallback(done);
  }
  const int64_t handle = *static_cast<const int64_t*>(tf.TF_TensorData(h));
  tf.TF_DeleteTensor(h);
  TF_Tensor* t = nullptr;
  tf.TF_GetInput(ctx, 0, &t, st.s);
  if (!st.ok()) {
    tf.TF_OpKernelContext_Failure(ctx, st.s);
    return tf.TF_RunAsyncOpKernelDoneCallback(done);
  }
  std::vector<int64_t> dims = dims_of(t);
  if (!k.gather) tf.TF_SetOutput(ctx, 0, t, st.s);  // the result is the submit's output buffer
  tf.TF_DeleteTensor(t);
  if (!st.ok()) {
    tf.TF_OpKernelContext_Failure(ctx, st.s);
    return tf.TF_RunAsyncOpKernelDoneCallback(done);
  }
  Pending ready;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_pending.find(handle);
    if (it == g_pending.end()) {
      // A handle waited twice, or one from another process: an error, never a hang.
      ready.wait_ctx = ctx;
      ready.wait_done = done;
      ready.error = FX_INVALID;
      ready.message = "unknown or already waited fastxfer handle " + std::to_string(handle);
    } else {
      Pending& p = it->second;
      p.wait_ctx = ctx;
      p.wait_dtype = k.dtype;
      p.wait_dims = std::move(dims);
      if (!p.done) {  // the engine's callback completes this op, after we have returned
        p.wait_done = keep_done(done);
        p.wait_done_owned = true;
        return;
      }
      p.wait_done = done;
      ready = std::move(p);
      g_pending.erase(it);
    }
  }
  complete_wait(ready);
}

// ------------------------------------------------------------------------------------------
// Registration (when TensorFlow loads this library).

void same_shape(TF_ShapeInferenceContext* ctx, TF_Status* s) {
  TF_ShapeHandle* h = tf.TF_NewShapeHandle();
  tf.TF_ShapeInferenceContextGetInput(ctx, 0, h, s);
  if (tf.TF_GetCode(s) == kTfOk) tf.TF_ShapeInferenceContextSetOutput(ctx, 0, h, s);
  tf.TF_DeleteShapeHandle(h);
}

void submit_shape(TF_ShapeInferenceContext* ctx, TF_Status* s) {
  same_shape(ctx, s);
  if (tf.TF_GetCode(s) != kTfOk) return;
  TF_ShapeHandle* scalar = tf.TF_ShapeInferenceContextScalar(ctx);
  tf.TF_ShapeInferenceContextSetOutput(ctx, 1, scalar, s);
  tf.TF_DeleteShapeHandle(scalar);
}

void unknown_shape(TF_ShapeInferenceContext* ctx, TF_Status* s) { tf.TF_ShapeInferenceContextSetUnknownShape(ctx, s); }

constexpr const char* kTypes = "T: {float, double, half, bfloat16, int32, int64, uint8, int8, uint16, int16, bool}";
constexpr int kTypeList[] = {kTfFloat, kTfDouble, kTfHalf,  kTfBFloat16, kTfInt32, kTfInt64,
                             kTfUInt8, kTfInt8,   kTfUInt16, kTfInt16,   kTfBool};

bool register_op(const char* name, const std::vector<const char*>& inputs, const std::vector<const char*>& outputs,
                 const std::vector<const char*>& attrs, ShapeFn shape, std::string* err) {
  TF_OpDefinitionBuilder* b = tf.TF_NewOpDefinitionBuilder(name);
  for (const char* i : inputs) tf.TF_OpDefinitionBuilderAddInput(b, i);
  for (const char* o : outputs) tf.TF_OpDefinitionBuilderAddOutput(b, o);
  for (const char* a : attrs) tf.TF_OpDefinitionBuilderAddAttr(b, a);
  tf.TF_OpDefinitionBuilderSetIsStateful(b, true);  // never pruned, merged or constant-folded
  tf.TF_OpDefinitionBuilderSetShapeInferenceFunction(b, shape);
  Status st;
  tf.TF_RegisterOpDefinition(b, st.s);
  if (!st.ok()) *err = std::string("registering ") + name + ": " + tf.TF_Message(st.s);
  return st.ok();
}

template <class MakeBuilder>
bool register_kernels(const char* op, MakeBuilder make, std::string* err) {
  for (int t : kTypeList) {
    TF_KernelBuilder* b = make();
    Status st;
    tf.TF_KernelBuilder_TypeConstraint(b, "T", t, st.s);
    if (st.ok()) tf.TF_RegisterKernelBuilder((std::string(op) + "/CPU").c_str(), b, st.s);
    if (!st.ok()) {
      *err = std::string("registering the ") + op + " kernel: " + tf.TF_Message(st.s);
      return false;
    }
  }
  return true;
}

std::string register_all() {
  const char* why = resolve_tf_api();
  if (*why != '\0') return why;
  std::string err;
  const std::vector<const char*> submit_attrs = {
      kTypes, "kind: {'allreduce', 'broadcast', 'allgather', 'reducescatter', 'alltoall'}", "tensor_name: string",
      "reduce_op: int = 0", "compression: int = 0", "root: int = 0", "prescale_bits: int = 0",
      "postscale_bits: int = 0", "bucket_cap: int = 0", "process_set: int = 0", "hold: int = 0", "group: int = 0"};
  std::vector<const char*> splits_attrs = submit_attrs;
  splits_attrs.push_back("Tsplits: {int32, int64}");
  bool ok = register_op("FastxferSubmit", {"tensor: T"}, {"output: T", "handle: int64"}, submit_attrs, submit_shape,
                        &err) &&
            register_op("FastxferSubmitSplits", {"tensor: T", "splits: Tsplits"}, {"output: T", "handle: int64"},
                        splits_attrs, submit_shape, &err) &&
            register_op("FastxferWaitAlltoall", {"tensor: T", "handle: int64"}, {"result: T", "received_splits: int32"},
                        {kTypes}, unknown_shape, &err) &&
            register_op("FastxferWait", {"tensor: T", "handle: int64"}, {"result: T"}, {kTypes}, same_shape, &err) &&
            register_op("FastxferWaitGather", {"tensor: T", "handle: int64"}, {"result: T"}, {kTypes}, unknown_shape,
                        &err) &&
            register_kernels("FastxferSubmit",
                             [] { return tf.TF_NewKernelBuilder("FastxferSubmit", "CPU", submit_create, submit_compute,
                                                                submit_delete); },
                             &err) &&
            register_kernels("FastxferSubmitSplits",
                             [] { return tf.TF_NewKernelBuilder("FastxferSubmitSplits", "CPU", submit_create,
                                                                submit_compute, submit_delete); },
                             &err) &&
            register_kernels("FastxferWaitAlltoall",
                             [] { return tf.TF_NewAsyncKernelBuilder("FastxferWaitAlltoall", "CPU", wait_gather_create,
                                                                     wait_compute, wait_delete); },
                             &err) &&
            register_kernels("FastxferWait",
                             [] { return tf.TF_NewAsyncKernelBuilder("FastxferWait", "CPU", wait_create, wait_compute,
                                                                     wait_delete); },
                             &err) &&
            register_kernels("FastxferWaitGather",
                             [] { return tf.TF_NewAsyncKernelBuilder("FastxferWaitGather", "CPU", wait_gather_create,
                                                                     wait_compute, wait_delete); },
                             &err);
  return ok ? "" : err;
}

// TensorFlow collects the ops a library registers while it loads it: register them then.
struct Registrar {
  Registrar() { g_load_error = register_all(); }
} g_registrar;

}  // namespace

}  // namespace tfops
}  // namespace fastxfer

extern "C" {

// Called by fastxfer._core.connect_op_library with the engine's C interface. Returns "" when
// the ops are usable, else why not.
__attribute__((visibility("default"))) const char* fastxfer_tfops_connect(const fx_engine_api* api) {
  using fastxfer::tfops::g_load_error;
  if (!g_load_error.empty()) return g_load_error.c_str();
  if (api == nullptr || api->version != FX_C_API_VERSION || api->struct_size < sizeof(fx_engine_api))
    return "fastxfer._core and the op library come from different fastxfer builds (reinstall fastxfer)";
  fastxfer::tfops::g_api.store(api, std::memory_order_release);
  return "";
}

// How many allreduce/broadcast submits reduced in place (TensorFlow forwarded the input) and how
// many needed a second buffer (observability: docs/tensorflow.md, the tests).
__attribute__((visibility("default"))) void fastxfer_tfops_buffers(int64_t* forwarded, int64_t* allocated,
                                                                   int64_t* allocated_bytes) {
  *forwarded = fastxfer::tfops::g_forwarded.load();
  *allocated = fastxfer::tfops::g_allocated.load();
  *allocated_bytes = fastxfer::tfops::g_allocated_bytes.load();
}

// Collectives the ops have handed to the engine so far (fastxfer.tensorflow.submitted).
__attribute__((visibility("default"))) int64_t fastxfer_tfops_submitted() {
  return fastxfer::tfops::g_submitted.load(std::memory_order_relaxed);
}

// Collectives submitted but not yet waited for (tests: nothing may stay behind).
__attribute__((visibility("default"))) int64_t fastxfer_tfops_pending() {
  std::lock_guard<std::mutex> lk(fastxfer::tfops::g_mu);
  return static_cast<int64_t>(fastxfer::tfops::g_pending.size());
}

}  // extern "C"
