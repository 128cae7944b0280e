// SPDX-License-Identifier: Apache-2.0
#pragma once

// The current step's bookkeeping for the updates that do not run at step(): with a communicator,
// the steps the ranks agreed (front: the current one), whether the current one has begun, the
// optimizer settings it began with and the units it touched; on the guarded paths, the units
// whose updates wait for end_step. The step protocol decides what to do with them; this owns them.

#include "comm/reducer.hpp"

#include <taskswap/runtime.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

namespace taskswap::detail {

/// One step as the ranks agreed it: its reduction, and the units this rank only updates.
struct agreed_step {
  step_agreement agreement;
  std::vector<std::uint32_t> update_only;  // active elsewhere, not acquired here
};

class step_round {
 public:
  /// Appends a step the ranks agreed (plan_together, in plan order).
  void agree(agreed_step step) { agreed_.push_back(std::move(step)); }

  /// Begins the front agreed step with the optimizer settings `now`, if it has not begun: that
  /// step, or null where it has begun or none is agreed.
  [[nodiscard]] const agreed_step* begin(const adamw_options& now)
  {
    if (begun_ || agreed_.empty()) { return nullptr; }
    begun_ = true;
    optimizer_ = now;
    return &agreed_.front();
  }
  [[nodiscard]] bool begun() const noexcept { return begun_; }
  /// The settings every update of the step uses (those it began with), whichever rank's call order
  /// enqueues it: replicas stay identical when set_optimizer changes them mid-step.
  [[nodiscard]] const adamw_options& optimizer(const adamw_options& otherwise) const noexcept
  {
    return begun_ ? optimizer_ : otherwise;
  }
  /// A unit acquired, or held for an update, in the begun step: idle again at its end.
  void touched(std::uint32_t unit) { touched_.push_back(unit); }
  /// Ends the begun step: the units it touched (a streamed one twice: frozen, then trained).
  [[nodiscard]] std::vector<std::uint32_t> end()
  {
    agreed_.pop_front();
    begun_ = false;
    return std::exchange(touched_, {});
  }

  /// A guarded step's update that waits for end_step.
  void defer(std::uint32_t unit) { deferred_.push_back(unit); }
  [[nodiscard]] bool any_deferred() const noexcept { return !deferred_.empty(); }
  /// The deferred units, each once, in unit order (the order the finish sums them in).
  [[nodiscard]] std::span<const std::uint32_t> deferred()
  {
    std::sort(deferred_.begin(), deferred_.end());
    deferred_.erase(std::unique(deferred_.begin(), deferred_.end()), deferred_.end());
    return deferred_;
  }
  void clear_deferred() noexcept { deferred_.clear(); }

 private:
  std::deque<agreed_step> agreed_;
  bool begun_ = false;
  adamw_options optimizer_{};
  std::vector<std::uint32_t> touched_;
  std::vector<std::uint32_t> deferred_;
};

}  // namespace taskswap::detail
