// ShmCollectives: the shared-memory segment plus the per-algorithm files that use it.
#include "collectives/shm_collectives.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace fastxfer {

namespace {

// The allreduce splits every chunk into one 64-byte-aligned shard per rank for every dtype pair
// (float32 values on a 16-bit wire are the tightest: 32 elements of 4 bytes per rank), so half a
// window must hold 128 bytes per rank. Checked before the segment is created.
const ShmConfig& checked(const ShmConfig& cfg) {
  const size_t window = ShmSegment::rounded_window_bytes(cfg.window_bytes);
  if (cfg.size >= 1 && window / 2 < static_cast<size_t>(cfg.size) * 128)
    throw std::invalid_argument("shared-memory window too small for " + std::to_string(cfg.size) +
                                " ranks: at least " + std::to_string(cfg.size * 256) + " bytes");
  return cfg;
}

}  // namespace

ShmCollectives::ShmCollectives(const ShmConfig& cfg, int threads, size_t stream_min_bytes)
    : seg_(checked(cfg)), ctx_(seg_) {
  ctx_.threads = threads;
  ctx_.stream_min_bytes = stream_min_bytes;
}

}  // namespace fastxfer
