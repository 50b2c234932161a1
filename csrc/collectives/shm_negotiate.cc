// Negotiation over shared memory: every rank publishes its list of request records and reads
// everyone's. Each rank has two record buffers, used in alternate rounds.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "collectives/shm_context.h"

namespace fastxfer {

void shm_exchange_records(ShmContext& c, const std::vector<Record>& mine, std::vector<std::vector<Record>>& all) {
  ShmSegment& seg = c.seg;
  const int max_records = seg.config().max_records;
  if (mine.size() > static_cast<size_t>(max_records)) throw std::invalid_argument("too many records for one round");
  const auto t0 = std::chrono::steady_clock::now();
  const int buf = static_cast<int>(c.round & 1);
  // 1. Write my records into my buffer for this round, then say so.
  std::memcpy(seg.records(seg.rank(), buf), mine.data(), mine.size() * sizeof(Record));
  *seg.record_count(seg.rank(), buf) = static_cast<uint32_t>(mine.size());
  const uint32_t next_round = static_cast<uint32_t>(c.round + 1);
  seg.publish(Phase::kRound, next_round);
  // 2. Wait for every rank's records of this round, then copy them out.
  seg.wait_all(Phase::kRound, next_round, "negotiation");
  all.resize(seg.size());
  for (int j = 0; j < seg.size(); ++j) {
    uint32_t n = std::min<uint32_t>(*seg.record_count(j, buf), static_cast<uint32_t>(max_records));
    all[j].assign(seg.records(j, buf), seg.records(j, buf) + n);
  }
  // Double-buffered: a peer rewrites this buffer two rounds from now, which it can only reach
  // after every rank (us included) has published round + 2, i.e. finished reading this one.
  ++c.round;
  ++c.stats.rounds;
  c.stats.negotiate += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace fastxfer
