#include "common/process.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

namespace fastxfer {

namespace {

std::atomic<uint64_t> generation{0};

void in_child() { generation.fetch_add(1, std::memory_order_relaxed); }

// Registered when the library loads, before any engine exists.
const bool registered = pthread_atfork(nullptr, nullptr, in_child) == 0;

}  // namespace

uint64_t fork_generation() {
  if (!registered) return static_cast<uint64_t>(getpid()) << 32;  // no handler: the pid tells instead
  return generation.load(std::memory_order_relaxed);
}

}  // namespace fastxfer
