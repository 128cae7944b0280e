// SPDX-License-Identifier: Apache-2.0
// The residency model: Note [One residency model] in runtime/residency/residency_model.hpp.

#include "runtime/residency/residency_model.hpp"

#include "comm/reducer.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"
#include "runtime/units/unit_layout.hpp"

#include <algorithm>
#include <utility>

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
    if (u.lookahead >= 0) {
      const auto steps = static_cast<std::size_t>(u.lookahead);
      horizon_ = horizon_ == no_next_step ? steps : std::max(horizon_, steps);
    }
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
  struct kept_unit {
    std::uint32_t unit;
    std::size_t bytes;
    std::size_t raw;
    std::size_t until;  // the entry that gives its room back (no_point: the step's end)
  };
  std::vector<kept_unit> kept;  // released, still counted (their reduction or update is to come)
  std::vector<std::uint32_t> trained_released;  // guarded: their update waits for the step's end
  std::size_t held_bytes = 0;
  std::size_t raw_bytes = 0;
  step_peak most;
  const auto held_names = [&] {
    std::string s;
    for (const held_unit& h : held) { s += (s.empty() ? "'" : ", '") + units_[h.unit].name + "'"; }
    std::string released;
    for (const kept_unit& k : kept) { released += (released.empty() ? "'" : ", '") + units_[k.unit].name + "'"; }
    return released.empty() ? s : s + "; released, still counted: " + released;
  };
  const std::span<const step_plan::entry> entries = step.entries();
  TASKSWAP_EXPECTS(rules.reduction_points.empty() || rules.reduction_points.size() == entries.size(),
                   "reduction_points: one per entry of the step");
  for (std::size_t at = 0; at < entries.size(); ++at) {
    const step_plan::entry& e = entries[at];
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
      // keeps its room until its bucket's reduction is launched, which can wait for units released
      // later in the step; in a guarded step a trained unit keeps it until the step's end updates
      // it. A frozen use of its parameters alone (a streamed layer's forward) is reduced by no rank
      // and gives its room back at release.
      std::size_t until = at;
      if (it->trained && rules.trained_count_to_end) {
        until = no_point;
        trained_released.push_back(it->unit);
      } else if (it->trained && rules.wait_for_reduction) {
        until = rules.reduction_points.empty() ? no_point : std::max(at, rules.reduction_points[at]);
      }
      if (until == at) {
        held_bytes -= it->bytes;
        raw_bytes -= it->raw;
      } else if (it->bytes != 0) {
        kept.push_back({it->unit, it->bytes, it->raw, until});
      }
      held.erase(it);
      // The units whose bucket this release launches give their room back.
      std::erase_if(kept, [&](const kept_unit& k) {
        if (k.until != at) { return false; }
        held_bytes -= k.bytes;
        raw_bytes -= k.raw;
        return true;
      });
      continue;
    }
    if (it != held.end()) {
      throw config_error(
        message("plan step ", step_number, ": acquires '", u.name, "' while it is still held; release it in between"));
    }
    if ((e.use == unit_use::stash) != (u.activation && e.use != unit_use::frozen)) {
      throw config_error(message("plan step ", step_number, ": ", e.use == unit_use::stash ? "stashes" : "trains", " '",
                                 u.name, "', which is ",
                                 e.use == unit_use::stash ? "not an activation block; plan it trained or frozen, or "
                                                            "register it with activation = true"
                                                          : "an activation block; plan it stash (its write) or frozen "
                                                            "(its reads)"));
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
        rules.trained_count_to_end ? " (with loss scaling or clipping, trained units released within a step count "
                                     "until it ends)"
        : rules.wait_for_reduction ? " (with a communicator, a unit released whole within a step counts until its "
                                     "gradient bucket's reduction is launched, at the release of the last unit of "
                                     "its bucket and the buckets before it: [comm] bucket_cap sets their size; a "
                                     "frozen use of a unit no rank trains gives its room back at release)"
                                   : ""));
    }
  }
  return most;
}

std::vector<std::size_t> reduction_points(const step_plan& step, std::span<const std::uint32_t> order,
                                          std::span<const std::size_t> reach,
                                          std::span<const std::uint32_t> ready_at_start)
{
  const std::span<const step_plan::entry> entries = step.entries();
  // Each unit's place in `order`, sorted by unit: a plan's steps may hold thousands of units.
  std::vector<std::pair<std::uint32_t, std::size_t>> place;
  place.reserve(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) { place.emplace_back(order[i], i); }
  std::sort(place.begin(), place.end());
  const auto index_of = [&](std::uint32_t u) {
    const auto it = std::lower_bound(place.begin(), place.end(), std::pair{u, std::size_t{0}});
    return it != place.end() && it->first == u ? it->second : no_point;
  };
  // When each unit of `order` is ready: the release of its last use (none: the step's end).
  std::vector<std::size_t> ready(order.size(), no_point);
  std::vector<bool> seen(order.size(), false);
  for (std::size_t at = entries.size(); at-- > 0;) {
    const std::size_t i = index_of(entries[at].unit.value);
    if (i == no_point || seen[i]) { continue; }
    seen[i] = true;
    ready[i] = entries[at].acquire ? no_point : at;
  }
  for (const std::uint32_t u : ready_at_start) {
    if (const std::size_t i = index_of(u); i != no_point) { ready[i] = 0; }
  }
  // The launch of the buckets up to order[i]'s: the latest readiness of order[0 .. reach[i]).
  std::vector<std::size_t> latest(order.size() + 1, 0);  // latest[j]: of order[0 .. j)
  for (std::size_t j = 0; j < order.size(); ++j) { latest[j + 1] = std::max(latest[j], ready[j]); }
  std::vector<std::size_t> points(entries.size(), no_point);
  for (std::size_t at = 0; at < entries.size(); ++at) {
    if (entries[at].acquire) { continue; }
    const std::size_t i = index_of(entries[at].unit.value);
    points[at] = i == no_point ? at : std::max(at, latest[reach[i]]);
  }
  return points;
}

std::vector<std::size_t> residency_model::local_reduction_points(const step_plan& step, std::size_t bucket_cap) const
{
  std::vector<std::uint32_t> order;  // the trained units, highest id first (the reduction order)
  for (const step_plan::entry& e : step.entries()) {
    if (e.acquire && e.use == unit_use::train && e.unit.value < units_.size()) { order.push_back(e.unit.value); }
  }
  std::sort(order.begin(), order.end(), std::greater<>());
  order.erase(std::unique(order.begin(), order.end()), order.end());
  std::vector<std::size_t> bytes;
  bytes.reserve(order.size());
  for (const std::uint32_t u : order) { bytes.push_back(units_[u].reduce_bytes); }
  return reduction_points(step, order, bucket_reach(bytes, bucket_cap));
}

// Note [Victims beyond the lookahead]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Belady's rule takes the unit used furthest in the future. A prefetch for a later step is
// conservative (docs/runtime.md): it takes the unit Belady takes when that step comes, and waits
// while that unit is held. Where the unit the trainer holds now is used again only far ahead, it
// is Belady's choice, and the prefetch waits for its release: the swap-in then has only the time
// between two steps. Beyond the prefetch horizon (the longest lookahead) the rule ranks no next
// use before another: those units go first, the least recently released first. The unit held
// now, or needed before the use the room is for, is released after every idle one, so it is
// never that choice while an idle unit lies beyond the horizon, and the choice a prefetch makes
// early is the one an acquire makes at the use: the planner, which replays acquires, predicts it.
// Within the horizon Belady's rule holds. With no unit prefetched the horizon is the whole plan.
// The cost is Belady's optimum beyond the horizon: a unit used in 10 steps may go before one used
// in 40 (runtime_eviction tests: no more than the optimum where the horizon covers the sequence).
std::size_t residency_model::choose_victim(std::span<const victim_candidate> candidates) noexcept
{
  const auto better = [](const victim_candidate& c, const victim_candidate& b) {
    if (c.beyond != b.beyond) { return c.beyond; }
    if (!c.beyond && c.next_use != b.next_use) { return c.next_use > b.next_use; }
    if (c.idle != b.idle) { return c.idle; }
    return c.last_release < b.last_release;
  };
  std::size_t best = candidates.size();
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (best == candidates.size() || better(candidates[i], candidates[best])) { best = i; }
  }
  if (best != candidates.size() && !candidates[best].idle) { return candidates.size(); }
  return best;
}

}  // namespace taskswap::detail
