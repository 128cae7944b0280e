// SPDX-License-Identifier: Apache-2.0
// The plan: each step's budget check, and agreeing the steps' units with the other ranks.

#include "runtime/runtime_impl.hpp"

#include <algorithm>

namespace taskswap {

using detail::message;

void runtime::impl::plan(std::span<const step_plan> steps)
{
  check_comm();
  for (std::size_t k = 0; k < steps.size(); ++k) { check_step(steps[k], ledger_.step() + plan_.planned_steps() + k); }
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
  (void)model_->check_step(step, step_number,
                           {.released_count_to_end = reducer_.has_value(), .trained_count_to_end = guard_.has_value()},
                           frozen_reduced);
}

// ---- with a communicator ----------------------------------------------------------------------

// Agrees with the other ranks on the steps' units, then plans each step with the units other
// ranks train and this one does not acquired first (this rank applies their update too) and
// released at its end, and checks the budget again with them.
void runtime::impl::plan_together(std::span<const step_plan> steps)
{
  const std::uint64_t first = ledger_.step() + plan_.planned_steps();
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
  std::vector<detail::agreed_step> agreed_steps;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    detail::agreed_step a{std::move(agreed[k]), {}};
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
      for (const std::uint32_t u : frozen_reduced[k]) {
        others += (others.empty() ? "'" : ", '") + units_[u].name + "'";
      }
      throw config_error(message(e.what(), others.empty() ? "" : ". The step includes units other ranks train (",
                                 others, others.empty() ? "" : "), which this rank holds whole for their update"));
    }
    full_steps[k] = std::move(full);
    agreed_steps.push_back(std::move(a));
  }
  for (std::size_t k = 0; k < steps.size(); ++k) {  // all checked: nothing is planned half
    plan_.append(full_steps[k], frozen_reduced[k]);
    round_.agree(std::move(agreed_steps[k]));
  }
}

}  // namespace taskswap
