// The error types every layer throws; the bindings map them to fastxfer's Python exceptions
// (PeerFailure -> PeerFailureError, Mismatch -> MismatchError, EngineError -> FastxferError).
#pragma once
#include <stdexcept>

namespace fastxfer {

// A peer died, exited, or did not answer within the timeout.
class PeerFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Ranks disagree on what to do next (names, shapes, dtypes, ops, counts or order).
class Mismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Anything else the engine or transport cannot recover from (e.g. shared memory unavailable).
class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fastxfer
