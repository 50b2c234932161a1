// The engine's timeline (FASTXFER_TIMELINE=path): a Chrome-trace file (chrome://tracing,
// ui.perfetto.dev) of where every collective spent its time, in the spirit of HOROVOD_TIMELINE.
//
// One process per rank (pid = rank). Timestamps are CLOCK_MONOTONIC microseconds plus the rank's
// offset to rank 0's clock (zero on one host, where every process reads the same clock; measured
// over MPI at init across hosts), so the ranks' traces line up; fastxfer.comm.timeline gathers them
// into the job's one file, the times shifted to start at zero. start()/stop() turn it on and off at
// run time (hvd.start_timeline/stop_timeline); mark_cycles adds an instant event at every
// negotiation round (HOROVOD_TIMELINE_MARK_CYCLES).
// Lane 0 is the engine thread: negotiation rounds, buckets
// (tensors, bytes, wire format) and the time it sat idle waiting for work. Every tensor name
// gets a lane of its own: "queued" (submitted -> every rank agreed to run it), "wait" (agreed ->
// its bucket starts), "reduce" (its bucket, start to end). Step marks (fastxfer.keras marks
// each training step) are instant events across the whole process.
//
// Events are buffered and appended to the file in batches (a few thousand at a time) by the
// thread that records them; the file is a JSON array closed at shutdown (Chrome also reads an
// unclosed one, e.g. after a crash).
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastxfer {

class Timeline {
 public:
  // An empty path: off until start(). Every call below returns at once while it is off.
  Timeline(const std::string& path, int rank, double offset_us = 0, bool mark_cycles = false);
  // Starts writing to `path` (truncated); throws when it cannot be opened. Stops a running one first.
  void start(const std::string& path, bool mark_cycles);
  // A negotiation round (only with mark_cycles).
  void cycle();
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool enabled() const { return on_.load(std::memory_order_relaxed); }
  // Microseconds on the timeline's clock (steady, since the engine started).
  double now() const;
  // The lane of a tensor name (lanes beyond kMaxLanes share one "other tensors" lane).
  int lane(const std::string& tensor);
  // A complete event [t0, t1] on `lane`; `args` is a JSON object body ("\"k\": 1") or empty.
  void span(int lane, const char* cat, const std::string& name, double t0, double t1, const std::string& args = "");
  // A process-wide instant event (a step mark).
  void mark(const std::string& name);
  // Writes what is buffered and closes the JSON array (idempotent): stop().
  void close();

  static constexpr int kEngineLane = 0;
  static constexpr int kMaxLanes = 2048;

 private:
  void flush_locked();
  static std::string escape(const std::string& s);

  std::FILE* file_ = nullptr;
  std::atomic<bool> on_{false};
  int rank_ = 0;
  double offset_ = 0;
  std::atomic<bool> mark_cycles_{false};
  std::mutex mu_;
  std::string buf_;
  size_t events_ = 0;
  std::unordered_map<std::string, int> lanes_;
};

}  // namespace fastxfer
