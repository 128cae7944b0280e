// SPDX-License-Identifier: Apache-2.0
// all_pinned_budget(): the least budget in whole granules that holds every unit pinned, with and
// without the guarded step's state; one granule less is refused by the runtime itself.

#include "expect_error.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = 1024;

std::vector<unit_spec> odd_units()
{
  std::vector<unit_spec> u(3);
  u[0] = {.name = "a", .tensors = {{"w", {33, 17}}}};
  u[1] = {.name = "b", .tensors = {{"w", {100, 7}}, {"b", {7}}}, .compute = dtype::bf16};
  u[2] = {.name = "c", .tensors = {{"w", {64, 64}}}, .trainable = false};
  return u;
}

// Whether a runtime with every unit pinned in `budget` starts and steps each unit once.
bool fits(runtime_options o, std::size_t budget, const std::vector<unit_spec>& units)
{
  o.device.budget = budget;
  try {
    const device dev = make_device(o.device);
    runtime rt(dev, o, units);
    stream s(dev);
    for (std::uint32_t i = 0; i < units.size(); ++i) {
      (void)rt.acquire({i}, s, units[i].trainable ? unit_use::train : unit_use::frozen);
      rt.release({i}, s);
    }
    (void)rt.end_step();
    return true;
  } catch (const out_of_memory&) {
    return false;
  } catch (const config_error&) {
    return false;
  }
}

TEST(all_pinned_budget, is_the_least_budget_in_whole_granules_that_holds_every_unit_pinned)
{
  runtime_options o;
  o.device.backend = backend_kind::emulated;
  o.device.emulated.memory_bytes = 4U << 20U;
  o.device.emulated.granularity = 4 * KiB;
  o.defaults.residency = residency::pinned;
  const std::vector<unit_spec> units = odd_units();
  for (const bool guarded : {false, true}) {
    SCOPED_TRACE(guarded ? "clipped" : "plain");
    o.optimizer.clip = guarded ? 1.0 : 0.0;
    const std::size_t b = all_pinned_budget(o, units);
    EXPECT_EQ(b % (4 * KiB), 0U);
    EXPECT_TRUE(fits(o, b, units));
    EXPECT_FALSE(fits(o, b - 4 * KiB, units)) << "a granule less does not hold them";
  }
}

}  // namespace
}  // namespace taskswap::test
