// Element-wise reduction of N ranks' shards (in the wire dtype) into one, in a fixed rank order.
#pragma once
#include <cstddef>

#include "common/dtype.h"
#include "common/request.h"

namespace fastxfer {

// dst[i] = scale * op(srcs[0][i], ..., srcs[nsrc-1][i]), all arrays of `wire` elements.
// bf16/fp16 are decoded and combined in float32 and rounded once at the end (after scaling), so
// an average never overflows fp16 on the way. Floats: sum/average add in rank order 0..N-1, so
// the result does not depend on which rank computes it; min/max propagate NaN. Integers:
// sums and products wrap (two's complement); a scale (1/size for an average) multiplies in double
// and truncates toward zero, as Horovod does. bool: sum/max = or, min/product = and, no average.
// product: floats multiply in rank order (16-bit ones in float32, rounded once). dst may alias
// srcs[k] (each block is read before it is written).
void reduce_block(ReduceOp op, DType wire, const void* const* srcs, int nsrc, void* dst, size_t n, double scale);

// The same, with rank `self`'s contribution read straight from its tensor (dtype `own`: the
// wire dtype, or float32 when the wire is bf16/fp16 — then it is rounded to the wire format in
// registers first, exactly as packing would have). The result goes both to `dst` (wire dtype,
// for the peers) and to `out` (dtype `own`: decompressed, for this rank's own tensor). This skips
// packing this rank's own shard and copying it back: ~30% fewer bytes moved per allreduce.
void reduce_block_direct(ReduceOp op, DType wire, DType own, const void* const* srcs, int nsrc, int self,
                         void* dst, void* out, size_t n, double scale);

}  // namespace fastxfer
