// Cross-process signalling through shared memory: counters that peers wait on (spin briefly,
// then sleep on a futex), and the liveness check that turns a dead peer into an error.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

namespace fastxfer {
namespace shm {

// One monotonically increasing 32-bit counter per cache line. Comparisons are serial-number
// arithmetic, so wrapping after 2^32 steps is harmless.
struct alignas(64) Counter {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;  // waiters inside futex_wait; publishers skip the wake syscall at 0
  char pad[56];
};
static_assert(sizeof(Counter) == 64, "one counter per cache line");

inline bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

// Stores `v` and wakes any process sleeping on the counter.
void publish(Counter& c, uint32_t v);

// Adds one to a counter that several processes add to (publish's plain store would let a late
// writer put back an older count) and wakes its sleepers.
void increment(Counter& c);

// Wakes every process sleeping on the counter without changing it.
void wake(Counter& c);

// Sleeps until the counter changes from `seen` or `timeout_ms` passes (spurious wake-ups allowed).
void sleep_on(Counter& c, uint32_t seen, int timeout_ms);

// Identity of a process that survives pid reuse: pid plus its start time (clock ticks since boot).
struct ProcessId {
  int32_t pid;
  uint64_t start;
};
ProcessId self_process_id();
// False when the process is gone, a zombie, or the pid now names a different process.
bool process_alive(const ProcessId& p);
// The process's state letter from /proc/<pid>/stat ('R', 'S', 'T' stopped, ...); 0 when unknown.
char process_state(const ProcessId& p);

}  // namespace shm
}  // namespace fastxfer
