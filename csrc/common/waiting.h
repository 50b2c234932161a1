// Whether the current thread waits for its own result: a synchronous call that runs its own round
// (Engine::wait). Such a thread has nothing else to run while it waits, so the time it spins is
// its own; the engine thread's waits overlap the computation (the backward pass of the TensorFlow
// ops it serves), which needs the core. The shared-memory waits lengthen their spin only on such
// a thread (ShmSegment::wait_one; docs/architecture.md, "Waiting for a peer").
#pragma once

namespace fastxfer {

class OwnResultWait {
 public:
  OwnResultWait() : was_(on_) { on_ = true; }
  ~OwnResultWait() { on_ = was_; }
  OwnResultWait(const OwnResultWait&) = delete;
  OwnResultWait& operator=(const OwnResultWait&) = delete;
  static bool active() { return on_; }

 private:
  bool was_;
  static inline thread_local bool on_ = false;
};

}  // namespace fastxfer
