// SPDX-License-Identifier: Apache-2.0
// The plan: each step's budget check, and agreeing the steps' units with the other ranks.

#include "runtime/runtime_impl.hpp"

#include "device/log.hpp"

#include <algorithm>

namespace taskswap {

using detail::bytes_text;
using detail::message;

namespace {

// The steps as planned with the other ranks: each with the units other ranks train that this
// rank updates, and the units it uses frozen that other ranks train.
struct plan_agreed {
  std::vector<step_plan> steps;
  std::vector<std::vector<std::uint32_t>> frozen_reduced;
};

// Before the ranks agree: with a communicator, the room of a unit this rank trains comes back
// when its bucket's reduction is launched, at the latest where bucket_reach says.
void check_step(const runtime::impl& rt, const step_plan& step, std::uint64_t step_number)
{
  const std::vector<std::size_t> points =
    rt.reduced_ ? rt.residency_.model->local_reduction_points(step, rt.options_.comm.bucket_cap)
                : std::vector<std::size_t>{};
  (void)rt.residency_.model->check_step(step, step_number,
                                        {.wait_for_reduction = rt.reduced_.has_value(),
                                         .trained_count_to_end = rt.guard_.has_value(),
                                         .reduction_points = points});
}

// A unit trained with its AdamW on the host keeps its home block in use from its acquire (the
// swap-in reads it) to its update (its gradients come home, the CPU steps the block), and to its
// release: to the step's end where the plan releases nothing, or where the update waits for the
// step's end (a guard, a communicator). So does a unit used frozen here that other ranks train
// (`frozen_reduced`: this replica takes their update). The cache keeps those blocks, and the one
// being read for any other use, together. Where they do not fit, the step still runs, bitwise the
// same, but reads those homes again within it. Checked once the steps are planned (a plan refused
// says nothing here).
void check_host_cache(runtime::impl& rt, std::span<const step_plan> steps, std::uint64_t first,
                      std::span<const std::vector<std::uint32_t>> frozen_reduced)
{
  if (!rt.memory_.homes.cache || rt.life_.warned_host_cache) { return; }
  const detail::host_cache& cache = *rt.memory_.homes.cache;
  const auto block = [&](std::uint32_t u) {
    return rt.units_.at(unit_id{u}).home.cache == nullptr ? std::size_t{0} : cache.block_bytes(rt.units_[u].home.entry);
  };
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto stays = [&](const step_plan::entry& e) {
      const bool reduced_here =
        k < frozen_reduced.size() &&
        std::find(frozen_reduced[k].begin(), frozen_reduced[k].end(), e.unit.value) != frozen_reduced[k].end();
      return rt.units_.at(e.unit).policy.optimizer == optimizer_placement::host &&
             (e.use == unit_use::train || reduced_here);
    };
    const detail::homes_in_use in_use =
      detail::count_homes_in_use(steps[k], block, stays, rt.guard_.has_value() || rt.reduced_.has_value());
    if (in_use.bytes > cache.capacity()) {
      rt.life_.warned_host_cache = true;
      detail::log(log_level::warning,
                  message("plan step ", first + k, " keeps ", bytes_text(in_use.bytes),
                          " of disk homes in use at once (", in_use.staying,
                          " units whose AdamW runs on the host, from their acquire to their update), more than the ",
                          bytes_text(cache.capacity()),
                          " host cache: the step runs, bitwise the same, but reads those homes again within it. "
                          "Raise [storage] host_cache to at least ",
                          bytes_text(in_use.bytes)));
      return;
    }
  }
}

// With a communicator, as agreed: `reduced` the step's agreement, `frozen_reduced` units the
// step uses frozen here that other ranks train (they take their whole slot), `update_only`
// units only other ranks train (ready at the step's start).
void check_agreed_step(const runtime::impl& rt, const step_plan& step, std::uint64_t step_number,
                       const detail::step_agreement& reduced, std::span<const std::uint32_t> frozen_reduced,
                       std::span<const std::uint32_t> update_only)
{
  std::vector<std::size_t> reach(reduced.order.size());
  std::size_t from = 0;
  for (const std::size_t end : reduced.bucket_end) {
    std::fill(reach.begin() + static_cast<std::ptrdiff_t>(from), reach.begin() + static_cast<std::ptrdiff_t>(end), end);
    from = end;
  }
  const std::vector<std::size_t> points = detail::reduction_points(step, reduced.order, reach, update_only);
  (void)rt.residency_.model->check_step(
    step, step_number,
    {.wait_for_reduction = true, .trained_count_to_end = rt.guard_.has_value(), .reduction_points = points},
    frozen_reduced);
}

// ---- with a communicator ----------------------------------------------------------------------

// Agrees with the other ranks on the steps' units, then plans each step with the units other
// ranks train and this one does not acquired first (this rank applies their update too) and
// released at its end, and checks the budget again with them.
plan_agreed plan_together(runtime::impl& rt, std::span<const step_plan> steps)
{
  const std::uint64_t first = rt.ledger_.step() + rt.residency_.plan.planned_steps();
  std::vector<std::vector<std::uint32_t>> trained(steps.size());
  std::vector<std::vector<std::uint32_t>> frozen(steps.size());
  std::vector<std::vector<std::uint32_t>> frozen_again(steps.size());  // acquired frozen more than once
  for (std::size_t k = 0; k < steps.size(); ++k) {
    for (const step_plan::entry& e : steps[k].entries()) {
      if (!e.acquire || e.use == unit_use::stash) { continue; }  // an activation block: this rank's own
      const auto seen = [&](const std::vector<std::uint32_t>& v) {
        return std::find(v.begin(), v.end(), e.unit.value) != v.end();
      };
      // A streamed layer is acquired frozen for its forward and again for its backward (frozen,
      // or trained); its trained use ends its gradients, which are reduced with the other ranks'.
      if (seen(trained[k])) {
        throw config_error(message("plan step ", first + k, ": acquires '", rt.units_[e.unit.value].name,
                                   "' after its trained use. With a communicator a unit's trained use is its last in "
                                   "a step (its release ends its gradients, reduced with the other ranks'): acquire "
                                   "it frozen before it (a forward), train it once, never use it after"));
      }
      if (e.use == unit_use::frozen) {
        (seen(frozen[k]) ? frozen_again[k] : frozen[k]).push_back(e.unit.value);
      } else {
        trained[k].push_back(e.unit.value);
      }
    }
  }
  // Only what a rank trains is counted: a frozen use contributes nothing to the agreement.
  std::vector<detail::step_agreement> agreed = rt.reduced_->reduction().agree(trained, first);
  std::vector<step_plan> full_steps(steps.size());
  std::vector<std::vector<std::uint32_t>> frozen_reduced(steps.size());
  std::vector<detail::agreed_step> agreed_steps;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    detail::agreed_step a{std::move(agreed[k]), {}};
    for (const std::uint32_t u : a.agreement.order) {
      const auto in = [&](const std::vector<std::uint32_t>& v) { return std::find(v.begin(), v.end(), u) != v.end(); };
      if (in(trained[k])) { continue; }
      if (in(frozen_again[k])) {
        throw config_error(message("plan step ", first + k, ": acquires '", rt.units_[u].name,
                                   "' frozen more than once while the step reduces it (other ranks train it, or [comm] "
                                   "reduce = \"every_unit\"). This rank takes the update at its frozen use's release, "
                                   "so it uses it frozen once in that step (or trains it too)"));
      }
      if (in(frozen[k])) {
        frozen_reduced[k].push_back(u);  // used frozen here, trained elsewhere: this replica takes the update
      } else {
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
      check_agreed_step(rt, full, first + k, a.agreement, frozen_reduced[k], a.update_only);
    } catch (const config_error& e) {
      std::string others;
      for (const std::uint32_t u : a.update_only) {
        others += (others.empty() ? "'" : ", '") + rt.units_[u].name + "'";
      }
      for (const std::uint32_t u : frozen_reduced[k]) {
        others += (others.empty() ? "'" : ", '") + rt.units_[u].name + "'";
      }
      throw config_error(message(e.what(), others.empty() ? "" : ". The step includes units other ranks train (",
                                 others, others.empty() ? "" : "), which this rank holds whole for their update"));
    }
    full_steps[k] = std::move(full);
    agreed_steps.push_back(std::move(a));
  }
  for (std::size_t k = 0; k < steps.size(); ++k) {  // all checked: nothing is planned half
    rt.residency_.plan.append(full_steps[k], frozen_reduced[k]);
    rt.reduced_->agree(std::move(agreed_steps[k]));
  }
  return {.steps = std::move(full_steps), .frozen_reduced = std::move(frozen_reduced)};
}

}  // namespace

void runtime::impl::plan(std::span<const step_plan> steps)
{
  check_comm();
  const std::uint64_t first = ledger_.step() + residency_.plan.planned_steps();
  for (std::size_t k = 0; k < steps.size(); ++k) { check_step(*this, steps[k], first + k); }
  if (reduced_) {
    derive_params();
    sync_replicas();
    const plan_agreed full = plan_together(*this, steps);
    check_host_cache(*this, full.steps, first, full.frozen_reduced);
  } else {
    for (const step_plan& s : steps) { residency_.plan.append(s); }
    check_host_cache(*this, steps, first, {});
  }
  start();
  prefetch();
}

}  // namespace taskswap
