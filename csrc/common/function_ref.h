// FunctionRef<R(Args...)>: a non-owning reference to a callable, for parameters that are called
// before the function taking them returns (parallel_for, WorkerPool::run). Unlike a
// std::function, making one never allocates: a lambda that captures more than two pointers
// costs a std::function a heap block on every call, and these run for every small allreduce.
// The callable must outlive the FunctionRef (a lambda argument does: it lives to the end of the
// full expression).
#pragma once
#include <memory>
#include <type_traits>
#include <utility>

namespace fastxfer {

template <class Sig>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                              std::is_invocable_r_v<R, F&, Args...>>>
  FunctionRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): stands in for a callable
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... a) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(a)...);
        }) {}

  R operator()(Args... a) const { return call_(obj_, std::forward<Args>(a)...); }

 private:
  void* obj_;
  R (*call_)(void*, Args...);
};

}  // namespace fastxfer
