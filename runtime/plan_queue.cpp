// SPDX-License-Identifier: Apache-2.0
#include "runtime/plan_queue.hpp"

#include <algorithm>

namespace taskswap::detail {

void plan_queue::append(const step_plan& step)
{
  planned_step s;
  s.first_position = next_position_;
  for (const step_plan::entry& e : step.entries()) {
    if (e.acquire) {
      s.entries.push_back({e.unit, next_position_, false});
      uses_[e.unit.value].push_back(next_position_++);
    }
  }
  steps_.push_back(std::move(s));
}

std::optional<std::uint64_t> plan_queue::match(unit_id u)
{
  if (steps_.empty()) { return std::nullopt; }
  auto& entries = steps_.front().entries;
  for (std::size_t i = cursor_; i < entries.size(); ++i) {
    planned_entry& e = entries[i];
    if (e.consumed || e.unit != u) { continue; }
    e.consumed = true;
    // Earlier acquisitions of u in this step are consumed, so this is the front of its uses.
    uses_[u.value].pop_front();
    while (cursor_ < entries.size() && entries[cursor_].consumed) { ++cursor_; }
    return e.position;
  }
  return std::nullopt;
}

void plan_queue::end_step()
{
  if (steps_.empty()) { return; }
  for (const planned_entry& e : steps_.front().entries) {
    if (!e.consumed) { uses_[e.unit.value].pop_front(); }
  }
  steps_.pop_front();
  cursor_ = 0;
}

std::size_t plan_queue::step_distance(std::uint64_t position) const
{
  const auto it = std::upper_bound(steps_.begin(), steps_.end(), position,
                                   [](std::uint64_t p, const planned_step& s) { return p < s.first_position; });
  return static_cast<std::size_t>(it - steps_.begin()) - 1;
}

}  // namespace taskswap::detail
