// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the planner's tests share: a unit of one f32 tensor, and a plan input of units under one policy.

#include "planner.hpp"

#include <string>
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

}  // namespace taskswap::test
