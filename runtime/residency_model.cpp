// SPDX-License-Identifier: Apache-2.0
// The residency model: Note [One residency model] in runtime/residency_model.hpp.

#include "runtime/residency_model.hpp"

#include "device/message.hpp"
#include "runtime/unit_layout.hpp"

#include <algorithm>

namespace taskswap::detail {

residency_model::residency_model(std::size_t budget, std::size_t granule, std::size_t guard_bytes,
                                 std::vector<modelled_unit> units)
    : granule_(granule), units_(std::move(units))
{
  if (guard_bytes != 0) {
    guard_ = taken(guard_bytes);
    if (budget <= guard_) {
      throw config_error(message("[device] budget ", bytes_text(budget), " leaves nothing beside the ",
                                 bytes_text(guard_), " that loss scaling and clipping take; raise it"));
    }
  }
  capacity_ = (budget - guard_) / granule_ * granule_;
  packed_.reserve(units_.size());
  for (const modelled_unit& u : units_) {
    packed_.push_back(!u.pinned && packs(u.device_bytes, granule_));
    if (u.pinned) { pinned_packed_ += (u.device_bytes + slab_alignment - 1) / slab_alignment * slab_alignment; }
  }
  pinned_ = taken(pinned_packed_);  // packed, in whole granules
  if (pinned_ > capacity_) {
    throw config_error(message("the pinned units need ", bytes_text(pinned_), " of device memory", granule_note(),
                               " but the budget is ", bytes_text(capacity_),
                               "; raise [device] budget or pin fewer units"));
  }
  for (std::uint32_t i = 0; i < units_.size(); ++i) {
    const modelled_unit& u = units_[i];
    if (!u.pinned && charged(i, u.device_bytes) > capacity_ - pinned_) {
      throw config_error(message(
        "unit '", u.name, "' needs ", bytes_text(charged(i, u.device_bytes)), " of device memory", granule_note(),
        " but the budget leaves ", bytes_text(capacity_ - pinned_), " after pinned units; ",
        u.host_placement ? "raise [device] budget" : "raise [device] budget or choose optimizer = \"host\" for it"));
    }
  }
}

std::string residency_model::granule_note() const
{
  return granule_ > slab_alignment ? message(" (in whole granules of ", bytes_text(granule_), ")") : std::string();
}

step_peak residency_model::check_step(const step_plan& step, std::uint64_t step_number, const step_rules& rules,
                                      std::span<const std::uint32_t> whole_frozen) const
{
  struct held_unit {
    std::uint32_t unit;
    std::size_t bytes;  // what its acquisition takes of the budget
    std::size_t raw;  // its slab before rounding
    bool trained;
  };
  std::vector<held_unit> held;
  std::vector<std::uint32_t> kept;  // released, still counted (their reduction or update is to come)
  std::vector<std::uint32_t> trained_released;  // guarded: their update waits for the step's end
  std::size_t held_bytes = 0;
  std::size_t raw_bytes = 0;
  step_peak most;
  const auto held_names = [&] {
    std::string s;
    for (const held_unit& h : held) { s += (s.empty() ? "'" : ", '") + units_[h.unit].name + "'"; }
    std::string released;
    for (const std::uint32_t u : kept) { released += (released.empty() ? "'" : ", '") + units_[u].name + "'"; }
    return released.empty() ? s : s + "; released, still counted: " + released;
  };
  for (const step_plan::entry& e : step.entries()) {
    if (e.unit.value >= units_.size()) {
      throw config_error(message("plan step ", step_number, ": unit id ", e.unit.value, " is not registered (",
                                 units_.size(), " units)"));
    }
    const modelled_unit& u = units_[e.unit.value];
    const auto it = std::find_if(held.begin(), held.end(), [&](const held_unit& h) { return h.unit == e.unit.value; });
    if (!e.acquire) {
      if (it == held.end()) {
        throw config_error(message("plan step ", step_number, ": releases '", u.name,
                                   "', which the step has not acquired; acquire it earlier in the step"));
      }
      // With a communicator a unit released whole (trained, or frozen while other ranks train it)
      // may keep its room until its bucket is reduced, which can wait for units acquired later in
      // the step; in a guarded step a trained unit keeps it until the step's end updates it: count
      // such a unit to the end of the step. A frozen use of its parameters alone (a streamed
      // layer's forward) is reduced by no rank and gives its room back at release.
      if (!((rules.released_count_to_end || rules.trained_count_to_end) && it->trained)) {
        held_bytes -= it->bytes;
        raw_bytes -= it->raw;
      } else if (it->bytes != 0) {
        kept.push_back(it->unit);
      }
      if (rules.trained_count_to_end && it->trained) { trained_released.push_back(it->unit); }
      held.erase(it);
      continue;
    }
    if (it != held.end()) {
      throw config_error(
        message("plan step ", step_number, ": acquires '", u.name, "' while it is still held; release it in between"));
    }
    if (e.use == unit_use::train && u.never_trained) {
      throw config_error(message("plan step ", step_number, ": trains '", u.name,
                                 "', which is registered never trained (trainable = false); plan it frozen, or "
                                 "register it trainable"));
    }
    if (std::find(trained_released.begin(), trained_released.end(), e.unit.value) != trained_released.end()) {
      throw config_error(message("plan step ", step_number, ": acquires '", u.name,
                                 "' again after training it; with "
                                 "loss scaling or clipping a trained unit's update waits for the step's end, so a step "
                                 "acquires it once (accumulate its micro-batches within one acquisition)"));
    }
    if (u.pinned) {
      held.push_back({e.unit.value, 0, 0, false});
      continue;
    }
    // A frozen use takes the parameters alone, unless other ranks train the unit in the step.
    const bool whole = e.use == unit_use::train ||
                       std::find(whole_frozen.begin(), whole_frozen.end(), e.unit.value) != whole_frozen.end();
    // The pool maps whole granules (a packed unit: a place, charged a granule) and never splits
    // free room, so the sum is the whole rule.
    const std::size_t need = use_charge(e.unit.value, whole);
    const std::size_t raw = whole ? u.device_bytes : u.params_bytes;
    held.push_back({e.unit.value, need, raw, whole});
    held_bytes += need;
    raw_bytes += raw;
    most = {std::max(most.held, held_bytes), std::max(most.raw, raw_bytes)};
    if (pinned_ + held_bytes > capacity_) {
      throw config_error(message(
        "plan step ", step_number, ": after acquiring '", u.name, "' the units held at once (", held_names(), ") take ",
        bytes_text(held_bytes), granule_note(), " and the pinned units ", bytes_text(pinned_), ", together ",
        bytes_text(pinned_ + held_bytes), " of a ", bytes_text(capacity_),
        " budget; release units earlier in the step, raise [device] budget or choose "
        "optimizer = \"host\"",
        rules.released_count_to_end  ? " (with a communicator, units released whole within a step count until it "
                                       "ends; a frozen use of a unit no rank trains gives its room back at release)"
        : rules.trained_count_to_end ? " (with loss scaling or clipping, trained units released within a step count "
                                       "until it ends)"
                                     : ""));
    }
  }
  return most;
}

std::size_t residency_model::choose_victim(std::span<const victim_candidate> candidates) noexcept
{
  std::size_t best = candidates.size();
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const victim_candidate& c = candidates[i];
    if (best == candidates.size()) {
      best = i;
      continue;
    }
    const victim_candidate& b = candidates[best];
    const bool released_earlier = (c.idle && !b.idle) || (c.idle == b.idle && c.last_release < b.last_release);
    if (c.next_use > b.next_use || (c.next_use == b.next_use && released_earlier)) { best = i; }
  }
  if (best != candidates.size() && !candidates[best].idle) { return candidates.size(); }
  return best;
}

}  // namespace taskswap::detail
