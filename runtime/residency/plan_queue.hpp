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

/// How a planned acquisition uses its unit, as far as residency is concerned.
enum class planned_use : std::uint8_t {
  train,  // the whole unit: parameters, optimizer state (device placement), gradients
  frozen,  // the parameters alone
  frozen_reduced,  // used frozen here while other ranks train it: whole, zero gradients, takes the update
  stash,  // an activation block's write: its slab mapped, not filled, and never prefetched
};

struct planned_acquisition {
  std::uint64_t position = 0;
  planned_use use = planned_use::train;
  /// Whether the acquisition needs the unit's whole slot (not its parameters alone).
  [[nodiscard]] bool whole() const noexcept { return use == planned_use::train || use == planned_use::frozen_reduced; }
};

class plan_queue {
 public:
  explicit plan_queue(std::size_t units) : uses_(units) {}

  /// Appends a step (validated by the caller); its frozen acquisitions of the units in
  /// `frozen_reduced` are planned_use::frozen_reduced.
  void append(const step_plan& step, std::span<const std::uint32_t> frozen_reduced = {});

  /// The first unconsumed planned acquisition of `u` in the current step, or nothing when the
  /// plan does not announce one.
  [[nodiscard]] std::optional<planned_acquisition> peek(unit_id u) const;
  /// As peek(), and consumes it.
  std::optional<planned_acquisition> match(unit_id u);
  /// Drops the unconsumed planned acquisitions of `u` in the current step (the trainer will not
  /// make them), but for the first if `keep_first`; returns how many.
  std::size_t drop(unit_id u, bool keep_first = false);
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
  /// How the planned acquisition at `position` (of the current or a later step) uses its unit.
  [[nodiscard]] planned_use use_at(std::uint64_t position) const;
  /// Calls `visit(unit, acquisition, distance)` for the unconsumed acquisitions of the current
  /// and the next `max_distance` steps, in order, until it returns false.
  template <typename Visit>
  void for_each_upcoming(std::size_t max_distance, Visit&& visit) const
  {
    const std::size_t last = max_distance + 1 < steps_.size() ? max_distance + 1 : steps_.size();
    for (std::size_t k = 0; k < last; ++k) {
      const auto& entries = steps_[k].entries;
      for (std::size_t i = k == 0 ? cursor_ : 0; i < entries.size(); ++i) {
        if (entries[i].consumed) { continue; }
        if (!visit(entries[i].unit, planned_acquisition{entries[i].position, entries[i].use}, k)) { return; }
      }
    }
  }

  [[nodiscard]] std::size_t planned_steps() const noexcept { return steps_.size(); }

 private:
  struct planned_entry {
    unit_id unit;
    std::uint64_t position;
    planned_use use = planned_use::train;
    bool consumed = false;
  };
  struct planned_step {
    std::vector<planned_entry> entries;
    std::uint64_t first_position = 0;
  };
  [[nodiscard]] std::size_t find(unit_id u) const;  // index in the current step, or its size

  std::deque<planned_step> steps_;
  std::size_t cursor_ = 0;  // entries of the current step before it are consumed
  std::uint64_t next_position_ = 0;
  std::vector<std::deque<std::uint64_t>> uses_;
};

}  // namespace taskswap::detail
