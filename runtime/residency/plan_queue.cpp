// SPDX-License-Identifier: Apache-2.0
#include "runtime/residency/plan_queue.hpp"

#include <algorithm>
#include <cstddef>

namespace taskswap::detail {

void plan_queue::append(const step_plan& step, std::span<const std::uint32_t> frozen_reduced)
{
  planned_step s;
  s.first_position = next_position_;
  for (const step_plan::entry& e : step.entries()) {
    if (!e.acquire) { continue; }
    planned_use use = e.use == unit_use::stash ? planned_use::stash : planned_use::train;
    if (e.use == unit_use::frozen) {
      const bool reduced =
        std::find(frozen_reduced.begin(), frozen_reduced.end(), e.unit.value) != frozen_reduced.end();
      use = reduced ? planned_use::frozen_reduced : planned_use::frozen;
    }
    s.entries.push_back({e.unit, next_position_, use, false});
    uses_[e.unit.value].push_back(next_position_++);
  }
  steps_.push_back(std::move(s));
}

std::size_t plan_queue::find(unit_id u) const
{
  if (steps_.empty()) { return 0; }
  const auto& entries = steps_.front().entries;
  std::size_t i = cursor_;
  while (i < entries.size() && (entries[i].consumed || entries[i].unit != u)) { ++i; }
  return i;
}

std::optional<planned_acquisition> plan_queue::peek(unit_id u) const
{
  const std::size_t i = find(u);
  if (steps_.empty() || i == steps_.front().entries.size()) { return std::nullopt; }
  const planned_entry& e = steps_.front().entries[i];
  return planned_acquisition{e.position, e.use};
}

std::optional<planned_acquisition> plan_queue::match(unit_id u)
{
  const std::size_t i = find(u);
  if (steps_.empty() || i == steps_.front().entries.size()) { return std::nullopt; }
  auto& entries = steps_.front().entries;
  planned_entry& e = entries[i];
  e.consumed = true;
  // Earlier acquisitions of u in this step are consumed, so this is the front of its uses.
  uses_[u.value].pop_front();
  while (cursor_ < entries.size() && entries[cursor_].consumed) { ++cursor_; }
  return planned_acquisition{e.position, e.use};
}

std::size_t plan_queue::drop(unit_id u, bool keep_first)
{
  if (steps_.empty()) { return 0; }
  auto& entries = steps_.front().entries;
  std::size_t dropped = 0;
  bool kept = !keep_first;
  for (std::size_t i = cursor_; i < entries.size(); ++i) {
    if (entries[i].consumed || entries[i].unit != u) { continue; }
    if (!kept) {
      kept = true;
      continue;
    }
    entries[i].consumed = true;
    ++dropped;
  }
  // The current step's unconsumed uses of u are the front of its queue (the earlier ones were
  // popped), the kept one first.
  auto& q = uses_[u.value];
  const auto first = q.begin() + (keep_first && !q.empty() ? 1 : 0);
  q.erase(first, first + static_cast<std::ptrdiff_t>(dropped));
  while (cursor_ < entries.size() && entries[cursor_].consumed) { ++cursor_; }
  return dropped;
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

planned_use plan_queue::use_at(std::uint64_t position) const
{
  const planned_step& s = steps_.at(step_distance(position));
  return s.entries.at(static_cast<std::size_t>(position - s.first_position)).use;
}

}  // namespace taskswap::detail
