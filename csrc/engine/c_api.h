/* The engine's C interface, for code that is built apart from the Python module and must not
 * depend on its C++ ABI: the TensorFlow op library (csrc/tfops/) gets this table from
 * fastxfer._core at run time (fastxfer_tfops_connect) and submits collectives through it.
 *
 * Requests are asynchronous and callback-driven: `submit` queues the collective on the engine
 * of this process (the one fastxfer.init() started, or a process set's) and returns at once; `done` is called
 * exactly once, on the engine's thread, when the collective has finished or failed. The input
 * must stay unchanged and both buffers alive until then. A request that `submit` refuses never
 * calls `done`.
 */
#ifndef FASTXFER_ENGINE_C_API_H_
#define FASTXFER_ENGINE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FX_C_API_VERSION 6

/* Values of fastxfer::CollectiveKind, DType, ReduceOp and Compression (common/). */
enum { FX_ALLREDUCE = 0, FX_BROADCAST = 1, FX_ALLGATHER = 2, FX_ALLTOALL = 6, FX_REDUCESCATTER = 7 };
enum { FX_FLOAT32 = 0, FX_FLOAT64, FX_FLOAT16, FX_BFLOAT16, FX_INT32, FX_INT64, FX_UINT8, FX_INT8, FX_UINT16, FX_INT16,
       FX_BOOL };
/* Error kinds (fastxfer::ErrorKind): the Python class a message belongs to. */
enum { FX_OK = 0, FX_PEER_FAILURE = 1, FX_MISMATCH = 2, FX_ENGINE_ERROR = 3, FX_INVALID = 4, FX_NOT_INITIALIZED = 5 };

typedef struct fx_request {
  int32_t kind;          /* FX_ALLREDUCE, FX_BROADCAST, FX_ALLGATHER, FX_ALLTOALL or FX_REDUCESCATTER */
  int32_t dtype;         /* FX_FLOAT32 ... */
  const char* name;      /* identical on every rank; compared, like the rest of the descriptor */
  const int64_t* shape;
  int32_t ndim;
  int32_t op;            /* fastxfer::ReduceOp */
  int32_t compression;   /* fastxfer::Compression (float32 only) */
  int32_t root;          /* broadcast */
  double prescale, postscale; /* op average: postscale is multiplied by 1/size of the engine that runs
                                 the request, when it is submitted (an elastic job's size can change
                                 after a graph holding the op was traced) */
  int64_t bucket_cap;    /* bytes; 0: the engine's default */
  const void* in;
  void* out;             /* allreduce/broadcast: numel elements; may equal `in` (in place). Allgather,
                            alltoall: unused. Reducescatter: this rank's rows, or NULL (then the result
                            arrives in `done`'s `gathered`) */
  const int64_t* splits; /* alltoall: rows sent to each rank (nsplits = size), or NULL: an equal split */
  int32_t nsplits;
  int32_t process_set;   /* 0: every rank (the job's engine); otherwise a process set this rank belongs
                            to (fastxfer/comm/process_sets.py), whose own engine runs the collective */
  int32_t hold;          /* non-zero: more requests of the same group follow at once; queue this one
                            without starting a round for it (the next request without hold releases
                            the group: Engine::submit) */
  int64_t group;         /* allreduce: its fusion group (0: none). Allreduces of different groups never
                            share a bucket (Horovod's groups=/num_groups=, grouped_allreduce); the
                            value is derived from the group's names, so ranks that agree on the names
                            agree on it */
} fx_request;

/* `gathered`/`gathered_bytes`/`rows`: an allgather's, alltoall's or (out == NULL) reducescatter's
 * result; `recv_splits`/`nsplits`: an alltoall's rows received from each rank. Readable only during
 * the call. */
typedef void (*fx_done_fn)(void* ctx, int32_t error, const char* message, const void* gathered,
                           size_t gathered_bytes, int64_t rows, const int64_t* recv_splits, int32_t nsplits);

typedef struct fx_engine_api {
  uint32_t version;     /* FX_C_API_VERSION */
  uint32_t struct_size; /* sizeof(fx_engine_api) */
  /* FX_OK: queued, `done` will be called. Otherwise the error kind, with a message in err[errlen]. */
  int32_t (*submit)(const fx_request* req, fx_done_fn done, void* ctx, char* err, size_t errlen);
} fx_engine_api;

#ifdef __cplusplus
}
#endif

#endif /* FASTXFER_ENGINE_C_API_H_ */
