// Which way a small allreduce bucket goes, measured rather than guessed: the one-exchange path
// (its data rides the negotiation's records: one wait, each rank reads every rank's data) or the
// chunk protocol (three waits, each rank reads its share). Which one is faster depends on the
// machine and on its load: on a quiet 2-core VM the chunks win from about 8 KiB, on the same VM
// under load the one-exchange path wins up to 32 KiB (docs/algorithms.md, "Which path, measured").
//
// Per size class (packed bytes rounded up to a power of two) the tuner keeps the last round times
// of each path and offers the one-exchange path while its median is not slower. One round in 16,
// chosen from the round number alone (so every rank of the set makes the same trial in the same
// round), runs one path or the other regardless, which keeps both medians fresh. A rank's offer is
// its own: the path runs only where every rank offered it (the minimum of the offers), so ranks
// whose measurements disagree run the chunks, correctly, and that is what they record.
// On by default (FASTXFER_EAGER_TUNE=0 turns it off: every bucket within the limit takes the
// one-exchange path). A warm round on either path allocates nothing (test_core.cc checks both).
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace fastxfer {

class EagerTuner {
 public:
  static constexpr int kClasses = 17;       // packed bytes up to 2^0 .. 2^16 (64 KiB, the largest slot)
  static constexpr int kWindow = 9;         // round times kept per class and path
  static constexpr int kMinSamples = 5;     // each path needs this many before the medians decide
  static constexpr uint64_t kWarmup = 64;   // offers of a class before its first trial (before: the path)

  enum class Trial { kNone, kEager, kChunks };

  // The trial round `round` makes: kEager in 1 round of 32, kChunks in another 1 of 32, from a
  // multiplicative hash of the round number (no period a training step's rounds could lock onto).
  static Trial trial(uint64_t round) {
    const uint64_t h = (round * 0x9E3779B97F4A7C15ull) >> 59;  // 5 bits
    return h == 0 ? Trial::kEager : h == 1 ? Trial::kChunks : Trial::kNone;
  }

  // ceil(log2(bytes)) for 1 <= bytes <= 64 KiB.
  static int size_class(size_t bytes) {
    int c = 0;
    while (c < kClasses - 1 && (size_t{1} << c) < bytes) ++c;
    return c;
  }

  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // Whether this rank offers the one-exchange path, in round `round`, for a bucket of `bytes`.
  bool offer(size_t bytes, uint64_t round) {
    if (!enabled()) return true;
    std::lock_guard<std::mutex> lk(mu_);
    State& s = classes_[size_class(bytes)];
    if (++s.offers <= kWarmup) return true;
    switch (trial(round)) {
      case Trial::kEager: return true;
      case Trial::kChunks: return false;
      case Trial::kNone: break;
    }
    return s.prefer_eager;
  }

  // A round whose whole batch was one such bucket ran on the one-exchange path (`eager`) or the
  // chunks, in `seconds` from this rank's offer to its outputs.
  void record(size_t bytes, bool eager, double seconds) {
    if (!enabled()) return;
    std::lock_guard<std::mutex> lk(mu_);
    State& s = classes_[size_class(bytes)];
    Path& p = eager ? s.eager : s.chunks;
    p.times[p.count % kWindow] = seconds;
    ++p.count;
    if (s.eager.count >= kMinSamples && s.chunks.count >= kMinSamples)
      s.prefer_eager = median(s.eager) <= median(s.chunks);
  }

  struct Row {
    size_t bytes;  // the class's upper bound in packed bytes
    uint64_t offers, eager_rounds, chunk_rounds;
    double eager_median_s, chunk_median_s;  // 0 where that path has no round yet
    bool prefer_eager;
  };
  // The classes with at least one offer, smallest first.
  std::vector<Row> rows() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Row> out;
    for (int c = 0; c < kClasses; ++c) {
      const State& s = classes_[c];
      if (s.offers == 0) continue;
      out.push_back({size_t{1} << c, s.offers, s.eager.count, s.chunks.count, median(s.eager), median(s.chunks),
                     s.prefer_eager});
    }
    return out;
  }

 private:
  struct Path {
    std::array<double, kWindow> times{};
    uint64_t count = 0;  // rounds recorded (the window holds the last min(count, kWindow))
  };
  struct State {
    uint64_t offers = 0;
    Path eager, chunks;
    bool prefer_eager = true;
  };
  static double median(const Path& p) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(p.count, kWindow));
    if (n == 0) return 0;
    std::array<double, kWindow> v = p.times;
    std::nth_element(v.begin(), v.begin() + n / 2, v.begin() + n);
    return v[n / 2];
  }

  std::atomic<bool> enabled_{false};
  mutable std::mutex mu_;
  std::array<State, kClasses> classes_{};
};

}  // namespace fastxfer
