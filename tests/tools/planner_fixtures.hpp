// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the planner's tests share: a unit of one f32 tensor, a plan input of units under one
// policy, a trainer's calls of ordered steps on the runtime, and the traffic compared.

#include "planner.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace taskswap::test {

inline unit_spec unit(const std::string& name, std::size_t n)
{
  return {.name = name, .tensors = {{"w", {n}}}, .compute = dtype::f32};
}

inline tools::plan_input input(std::vector<unit_spec> units, std::size_t budget, residency r, optimizer_placement o,
                               int lookahead = 2)
{
  tools::plan_input in;
  in.options.device = {.backend = backend_kind::emulated, .budget = budget};
  in.options.defaults = {.residency = r, .lookahead = lookahead, .optimizer = o};
  in.units = std::move(units);
  return in;
}

/// Makes the calls of `steps` on `rt` in order, as a trainer does: a trained use stepped before
/// its release, the units still held released at the step's end. Returns the steps' largest
/// device peak.
inline std::size_t run_calls(runtime& rt, std::span<const step_plan> steps, stream_view st)
{
  std::size_t peak = 0;
  for (const step_plan& p : steps) {
    std::vector<unit_id> trained;  // held for a trained use: stepped before its release
    const auto let_go = [&](unit_id u) {
      const auto it = std::find(trained.begin(), trained.end(), u);
      if (it != trained.end()) {
        rt.step(u, st);
        trained.erase(it);
      }
      rt.release(u, st);
    };
    std::vector<unit_id> held;
    for (const step_plan::entry& e : p.entries()) {
      if (!e.acquire) {
        let_go(e.unit);
        held.erase(std::find(held.begin(), held.end(), e.unit));
        continue;
      }
      (void)rt.acquire(e.unit, st, e.use);
      held.push_back(e.unit);
      if (e.use == unit_use::train) { trained.push_back(e.unit); }
    }
    for (const unit_id u : held) { let_go(u); }  // held to the step's end
    peak = std::max(peak, rt.end_step().peak_device_bytes);
  }
  return peak;
}

/// The planner's swap-ins and bytes per step over `steps` steps against what the runtime moved,
/// within `within` of the runtime's.
inline void expect_traffic_near(const tools::plan_report& r, const step_stats& total, double steps, double within,
                                const std::string& what)
{
  for (const auto& [planned, ran, name] : {std::tuple{r.swap_ins_per_step * steps, total.swap_ins, "swap-ins"},
                                           std::tuple{r.h2d_bytes_per_step * steps, total.h2d_bytes, "h2d bytes"},
                                           std::tuple{r.d2h_bytes_per_step * steps, total.d2h_bytes, "d2h bytes"}}) {
    EXPECT_NEAR(planned, static_cast<double>(ran), within * static_cast<double>(ran)) << name << ", " << what;
  }
}

}  // namespace taskswap::test
