// SPDX-License-Identifier: Apache-2.0
// The plan: each step's budget check, and agreeing the steps' units with the other ranks.

#include "runtime/runtime_impl.hpp"

#include <algorithm>

namespace taskswap {

using detail::bytes_text;
using detail::message;

void runtime::impl::plan(std::span<const step_plan> steps)
{
  check_comm();
  for (std::size_t k = 0; k < steps.size(); ++k) { check_step(steps[k], steps_done_ + plan_.planned_steps() + k); }
  if (reducer_) {
    sync_replicas();
    plan_together(steps);
  } else {
    for (const step_plan& s : steps) { plan_.append(s); }
  }
  planned_steps_ += steps.size();
  start();
  prefetch();
}

void runtime::impl::check_step(const step_plan& step, std::uint64_t step_number,
                               std::span<const std::uint32_t> frozen_reduced) const
{
  struct held_unit {
    std::uint32_t unit;
    std::size_t bytes;  // what its acquisition takes of the budget
    bool trained;
  };
  std::vector<held_unit> held;
  std::vector<std::uint32_t> trained_released;  // guarded: their update waits for the step's end
  std::size_t held_bytes = 0;
  const std::size_t budget = capacity_;
  const auto held_names = [&] {
    std::string s;
    for (const held_unit& h : held) { s += (s.empty() ? "'" : ", '") + units_[h.unit].name + "'"; }
    return s;
  };
  for (const step_plan::entry& e : step.entries()) {
    if (e.unit.value >= units_.size()) {
      throw config_error(message("plan step ", step_number, ": unit id ", e.unit.value, " is not registered (",
                                 units_.size(), " units)"));
    }
    const unit_record& r = units_[e.unit.value];
    const auto it = std::find_if(held.begin(), held.end(), [&](const held_unit& h) { return h.unit == e.unit.value; });
    if (!e.acquire) {
      if (it == held.end()) {
        throw config_error(message("plan step ", step_number, ": releases '", r.name,
                                   "', which the step has not acquired; acquire it earlier in the step"));
      }
      // With a communicator a released unit may keep its room until its bucket is reduced, which
      // can wait for units acquired later in the step; in a guarded step a trained unit keeps it
      // until the step's end updates it: count it to the end of the step.
      if (!reducer_ && !(guard_ && it->trained)) { held_bytes -= it->bytes; }
      if (guard_ && it->trained) { trained_released.push_back(it->unit); }
      held.erase(it);
      continue;
    }
    if (it != held.end()) {
      throw config_error(message("plan step ", step_number, ": acquires '", r.name,
                                 "' while it is still held; release it in between"));
    }
    if (e.use == unit_use::train && r.layout.frozen) {
      throw config_error(message("plan step ", step_number, ": trains '", r.name,
                                 "', which is registered never trained (trainable = false); plan it frozen, or "
                                 "register it trainable"));
    }
    if (std::find(trained_released.begin(), trained_released.end(), e.unit.value) != trained_released.end()) {
      throw config_error(message("plan step ", step_number, ": acquires '", r.name, "' again after training it; with "
                                 "loss scaling or clipping a trained unit's update waits for the step's end, so a step "
                                 "acquires it once (accumulate its micro-batches within one acquisition)"));
    }
    if (r.pinned()) {
      held.push_back({e.unit.value, 0, false});
      continue;
    }
    // A frozen use takes the parameters alone, unless other ranks train the unit in the step.
    const bool whole = e.use == unit_use::train ||
                       std::find(frozen_reduced.begin(), frozen_reduced.end(), e.unit.value) != frozen_reduced.end();
    // The pool maps whole granules (a packed unit: a place, charged a granule) and never splits
    // free room, so the sum is the whole rule.
    const std::size_t need = charged(r, whole ? r.layout.device_bytes : r.layout.params_bytes);
    held.push_back({e.unit.value, need, whole});
    held_bytes += need;
    if (pinned_bytes_ + held_bytes > budget) {
      throw config_error(message("plan step ", step_number, ": after acquiring '", r.name, "' the units held at once (",
                                 held_names(), ") take ", bytes_text(held_bytes), granule_note(), " and the pinned units ",
                                 bytes_text(pinned_bytes_), ", together ", bytes_text(pinned_bytes_ + held_bytes),
                                 " of a ", bytes_text(budget),
                                 " budget; release units earlier in the step, raise [device] budget or choose "
                                 "optimizer = \"host\"",
                                 reducer_ ? " (with a communicator, units released within a step count until it ends)"
                                 : guard_ ? " (with loss scaling or clipping, trained units released within a step count "
                                            "until it ends)"
                                          : ""));
    }
  }
}

// ---- with a communicator ----------------------------------------------------------------------

// Agrees with the other ranks on the steps' units, then plans each step with the units other
// ranks train and this one does not acquired first (this rank applies their update too) and
// released at its end, and checks the budget again with them.
void runtime::impl::plan_together(std::span<const step_plan> steps)
{
  const std::uint64_t first = steps_done_ + plan_.planned_steps();
  std::vector<std::vector<std::uint32_t>> trained(steps.size());
  std::vector<std::vector<std::uint32_t>> frozen(steps.size());
  for (std::size_t k = 0; k < steps.size(); ++k) {
    for (const step_plan::entry& e : steps[k].entries()) {
      if (!e.acquire) { continue; }
      const auto seen = [&](const std::vector<std::uint32_t>& v) {
        return std::find(v.begin(), v.end(), e.unit.value) != v.end();
      };
      if (seen(trained[k]) || seen(frozen[k])) {
        throw config_error(message("plan step ", first + k, ": acquires '", units_[e.unit.value].name,
                                   "' twice. With a communicator a unit is acquired once per step and held from "
                                   "forward through backward (its release is the end of its gradients); release "
                                   "and re-acquire within a step only without a communicator"));
      }
      (e.use == unit_use::frozen ? frozen[k] : trained[k]).push_back(e.unit.value);
    }
  }
  // Only what a rank trains is counted: a frozen use contributes nothing to the agreement.
  std::vector<detail::step_agreement> agreed = reducer_->agree(trained, first);
  std::vector<step_plan> full_steps(steps.size());
  std::vector<std::vector<std::uint32_t>> frozen_reduced(steps.size());
  std::vector<agreed_step> agreed_steps;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    agreed_step a{std::move(agreed[k]), {}};
    for (const std::uint32_t u : a.agreement.order) {
      const auto in = [&](const std::vector<std::uint32_t>& v) { return std::find(v.begin(), v.end(), u) != v.end(); };
      if (in(frozen[k])) {
        frozen_reduced[k].push_back(u);  // used frozen here, trained elsewhere: this replica takes the update
      } else if (!in(trained[k])) {
        a.update_only.push_back(u);
      }
    }
    std::sort(a.update_only.begin(), a.update_only.end());
    step_plan full;
    for (const std::uint32_t u : a.update_only) { full.acquire(unit_id{u}); }
    for (const step_plan::entry& e : steps[k].entries()) {
      if (e.acquire) {
        full.acquire(e.unit, e.use);
      } else {
        full.release(e.unit);
      }
    }
    for (const std::uint32_t u : a.update_only) { full.release(unit_id{u}); }
    try {
      if (!a.update_only.empty() || !frozen_reduced[k].empty()) {  // else plan() checked it as given
        check_step(full, first + k, frozen_reduced[k]);
      }
    } catch (const config_error& e) {
      std::string others;
      for (const std::uint32_t u : a.update_only) { others += (others.empty() ? "'" : ", '") + units_[u].name + "'"; }
      for (const std::uint32_t u : frozen_reduced[k]) { others += (others.empty() ? "'" : ", '") + units_[u].name + "'"; }
      throw config_error(message(e.what(), others.empty() ? "" : ". The step includes units other ranks train (",
                                 others, others.empty() ? "" : "), which this rank holds whole for their update"));
    }
    full_steps[k] = std::move(full);
    agreed_steps.push_back(std::move(a));
  }
  for (std::size_t k = 0; k < steps.size(); ++k) {  // all checked: nothing is planned half
    plan_.append(full_steps[k], frozen_reduced[k]);
    agreed_.push_back(std::move(agreed_steps[k]));
  }
}

}  // namespace taskswap
