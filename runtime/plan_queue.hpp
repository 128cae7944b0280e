// SPDX-License-Identifier: Apache-2.0
#pragma once

// The plan: the upcoming steps as the trainer announced them, the position of the step in
// progress, and for every unit the positions of its next acquisitions, which is what Belady's
// rule needs (evict the unit used furthest in the future). Positions number the planned
// acquisitions in order over all steps; they never repeat.

#include <taskswap/runtime.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <span>
#include <vector>

namespace taskswap::detail {

inline constexpr std::uint64_t never = std::numeric_limits<std::uint64_t>::max();

class plan_queue {
 public:
  explicit plan_queue(std::size_t units) : uses_(units) {}

  /// Appends a step (validated by the caller).
  void append(const step_plan& step);

  /// Consumes the first unconsumed planned acquisition of `u` in the current step; its
  /// position, or nothing when the plan did not announce it.
  std::optional<std::uint64_t> match(unit_id u);
  /// Leaves the current step: its unconsumed acquisitions are dropped.
  void end_step();

  /// The position of `u`'s next planned acquisition, or `never`.
  [[nodiscard]] std::uint64_t next_use(unit_id u) const
  {
    const auto& q = uses_[u.value];
    return q.empty() ? never : q.front();
  }
  /// The position of `u`'s first planned acquisition after `position`, or `never`.
  [[nodiscard]] std::uint64_t next_use_after(unit_id u, std::uint64_t position) const
  {
    const auto& q = uses_[u.value];
    const auto it = std::upper_bound(q.begin(), q.end(), position);
    return it == q.end() ? never : *it;
  }
  /// Steps from the current one (0) to the step holding `position`.
  [[nodiscard]] std::size_t step_distance(std::uint64_t position) const;
  /// Calls `visit(unit, position, distance)` for the unconsumed acquisitions of the current and
  /// the next `max_distance` steps, in order, until it returns false.
  template <typename Visit>
  void for_each_upcoming(std::size_t max_distance, Visit&& visit) const
  {
    const std::size_t last = max_distance + 1 < steps_.size() ? max_distance + 1 : steps_.size();
    for (std::size_t k = 0; k < last; ++k) {
      const auto& entries = steps_[k].entries;
      for (std::size_t i = k == 0 ? cursor_ : 0; i < entries.size(); ++i) {
        if (entries[i].consumed) { continue; }
        if (!visit(entries[i].unit, entries[i].position, k)) { return; }
      }
    }
  }

  [[nodiscard]] std::size_t planned_steps() const noexcept { return steps_.size(); }

 private:
  struct planned_entry {
    unit_id unit;
    std::uint64_t position;  // `never` for releases
    bool consumed = false;
  };
  struct planned_step {
    std::vector<planned_entry> entries;
    std::uint64_t first_position = 0;
  };
  std::deque<planned_step> steps_;
  std::size_t cursor_ = 0;  // entries of the current step before it are consumed
  std::uint64_t next_position_ = 0;
  std::vector<std::deque<std::uint64_t>> uses_;
};

}  // namespace taskswap::detail
