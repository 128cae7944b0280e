// SPDX-License-Identifier: Apache-2.0
#pragma once

// A reduced step's state (with a communicator): the reducer, the steps the ranks agreed (front:
// the current one), whether the current one has begun, the optimizer settings it began with and
// the units it touched. The step protocol decides what to do with them (step_reduction.cpp); this
// owns them.

#include "comm/reducer.hpp"

#include <taskswap/runtime.hpp>

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace taskswap::detail {

/// One step as the ranks agreed it: its reduction, and the units this rank only updates.
struct agreed_step {
  step_agreement agreement;
  std::vector<std::uint32_t> update_only;  // active elsewhere, not acquired here
};

class reduced_step {
 public:
  template <typename... ReducerArgs>
  explicit reduced_step(ReducerArgs&&... args) : reducer_(std::forward<ReducerArgs>(args)...)
  {}

  /// The gradients' buckets and their collectives.
  [[nodiscard]] reducer& reduction() noexcept { return reducer_; }
  [[nodiscard]] const reducer& reduction() const noexcept { return reducer_; }

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

 private:
  reducer reducer_;
  std::deque<agreed_step> agreed_;
  bool begun_ = false;
  adamw_options optimizer_{};
  std::vector<std::uint32_t> touched_;
};

}  // namespace taskswap::detail
