// futex-based waiting on counters in a shared (not private) mapping, and /proc liveness checks.
#include "transport/shm/sync.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace fastxfer {
namespace shm {

void publish(Counter& c, uint32_t v) {
  c.value.store(v, std::memory_order_seq_cst);
  // seq_cst on both sides: either the waiter sees the new value before sleeping, or we see it
  // counted in `sleepers` and wake it.
  if (c.sleepers.load(std::memory_order_seq_cst) != 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&c.value), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}


void wake(Counter& c) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&c.value), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void increment(Counter& c) {
  c.value.fetch_add(1, std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_seq_cst) != 0) wake(c);  // as publish: seq_cst on both sides
}

void sleep_on(Counter& c, uint32_t seen, int timeout_ms) {
  c.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (c.value.load(std::memory_order_seq_cst) == seen) {
    timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&c.value), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
  c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

namespace {

// Fields 3 (state) and 22 (starttime) of /proc/<pid>/stat; the command name (field 2) is in
// parentheses and may itself contain spaces or parentheses, so parse from the last ')'.
bool read_stat(int pid, char* state, uint64_t* start) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  std::ifstream f(path);
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  rest >> *state;
  // after state: fields 4..21 (18 of them), then starttime
  for (int i = 0; i < 18; ++i) rest >> field;
  rest >> *start;
  return static_cast<bool>(rest);
}

}  // namespace

ProcessId self_process_id() {
  ProcessId p{static_cast<int32_t>(getpid()), 0};
  char state;
  read_stat(p.pid, &state, &p.start);
  return p;
}

bool process_alive(const ProcessId& p) {
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(p.pid, &state, &start)) return false;
  if (state == 'Z' || state == 'X' || state == 'x') return false;
  return start == p.start;
}

char process_state(const ProcessId& p) {
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(p.pid, &state, &start) || start != p.start) return 0;
  return state;
}

}  // namespace shm
}  // namespace fastxfer
