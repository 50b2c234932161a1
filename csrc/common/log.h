// fastxfer: the native core's few messages of its own (a stall warning, a misused output buffer)
// follow the level of Python's `fastxfer` logger (FASTXFER_LOG_LEVEL, fastxfer/log.py), which the
// package hands down at import and at init. Levels are Python's numbers. They go to stderr as one
// line each, "fastxfer: ..." -- the engine's threads never call into Python.
#pragma once

#include <string>

namespace fastxfer {

enum LogLevel : int { kLogDebug = 10, kLogInfo = 20, kLogWarning = 30, kLogError = 40, kLogCritical = 50 };

void set_log_level(int level);  // messages below it are dropped
int log_level();
bool log_enabled(int level);
// One line on stderr, "fastxfer: <text>", flushed, when `level` is enabled.
void log_line(int level, const std::string& text);

}  // namespace fastxfer
