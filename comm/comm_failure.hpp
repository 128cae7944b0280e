// SPDX-License-Identifier: Apache-2.0
#pragma once

// The first failure of a communicator's collectives (a timeout or a library error), kept so that
// every later call on the communicator, and the trainer's next runtime call, throws it.

#include <atomic>
#include <exception>
#include <mutex>

namespace taskswap::detail {

class comm_failure {
 public:
  /// Keeps `e` unless a failure was kept already; true if `e` is the first.
  bool fail(std::exception_ptr e) noexcept
  {
    const std::lock_guard lock(mutex_);
    if (first_) { return false; }
    first_ = std::move(e);
    failed_.store(true, std::memory_order_release);
    return true;
  }
  [[nodiscard]] bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  /// Throws the kept failure, if any.
  void rethrow() const
  {
    if (!failed()) { return; }
    const std::lock_guard lock(mutex_);
    std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  mutable std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace taskswap::detail
