// Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
// Adaptive Summation", MLSys 2021), the reduction Horovod calls op=hvd.Adasum.
//
// Two gradients a and b combine, per tensor, as
//     adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
// (a coefficient is 1 when its vector's squared norm is below 1e-8): orthogonal gradients add,
// parallel ones average. N ranks combine pairwise over a binary tree in rank order, as Horovod's
// vector-halving distance-doubling algorithm does for a power-of-two N: ranks (0,1), (2,3), ...
// first, then the pairs' results (01, 23), and so on. Horovod refuses any other N; fastxfer first
// folds each rank r >= P (P: the largest power of two <= N) into rank r - P with the same pair
// rule, then runs the tree over the P results (docs/algorithms.md, "Adasum").
#pragma once
#include <cstddef>

#include "collectives/collectives.h"

namespace fastxfer {

// One fused allreduce with op Adasum: every rank packs its bucket (pre-scaled), the packed buckets
// are allgathered, and every rank combines them tensor by tensor, block by block in float64 (the
// same arithmetic everywhere, so every rank gets the same bits): two passes per pair of the tree
// (dot products, then the combination), inner nodes of the tree kept in float64, the root
// multiplied by the post-scale and rounded once to the wire dtype before unpacking. Float dtypes
// only (float32 compressed to bf16/fp16 on the wire too). The buffers stay with the engine thread
// between calls: n x the largest bucket gathered, plus one float64 vector per inner node for n > 2.
void adasum_allreduce(Collectives& comm, const AllreduceJob& job, int threads);

}  // namespace fastxfer
