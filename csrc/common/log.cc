#include "common/log.h"

#include <atomic>
#include <cstdio>

namespace fastxfer {

namespace {
std::atomic<int> g_level{kLogWarning};
}

void set_log_level(int level) { g_level.store(level, std::memory_order_relaxed); }

int log_level() { return g_level.load(std::memory_order_relaxed); }

bool log_enabled(int level) { return level >= log_level(); }

void log_line(int level, const std::string& text) {
  if (!log_enabled(level)) return;
  std::fprintf(stderr, "fastxfer: %s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace fastxfer
