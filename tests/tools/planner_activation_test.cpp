// SPDX-License-Identifier: Apache-2.0
// The planner's replay of activation blocks, checked against the runtime itself.

#include "planner.hpp"
#include "planner_fixtures.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace taskswap;
using taskswap::test::expect_traffic_near;
using taskswap::test::input;
using taskswap::test::run_calls;
using taskswap::test::unit;

}  // namespace

// Activation blocks in a streamed trunk: each layer's block stashed in the forward and read in
// the backward. The replay counts the stashes home, the reads that find a block gone, and the
// blocks in the peak, as the runtime runs them.
TEST(planner, ordered_steps_replay_activation_blocks_as_the_runtime_runs_them)
{
  constexpr std::uint32_t layers = 6;
  std::vector<unit_spec> units;
  for (std::uint32_t l = 0; l < layers; ++l) { units.push_back(unit("layer/" + std::to_string(l), 4096)); }
  for (std::uint32_t l = 0; l < layers; ++l) {
    unit_spec b = unit("act/" + std::to_string(l), 3072);
    b.activation = true;
    units.push_back(b);
  }
  const std::size_t layer = footprint(units[0], optimizer_placement::device).device_bytes;
  const std::size_t block = footprint(units[layers], optimizer_placement::device).param_bytes;
  for (const auto& [blocks_room, policy] :
       {std::pair{1U, residency::on_demand}, std::pair{4U, residency::on_demand}, std::pair{1U, residency::prefetch},
        std::pair{3U, residency::prefetch}, std::pair{7U, residency::prefetch}}) {
    const std::string what = std::to_string(blocks_room) + " blocks of room, " + std::string(to_string(policy));
    auto in = input(units, layer + blocks_room * block, policy, optimizer_placement::device, 1);
    for (int s = 0; s < 20; ++s) {
      step_plan p;
      for (std::uint32_t l = 0; l < layers; ++l) {
        const unit_id a{layers + l};
        p.acquire(unit_id{l}, unit_use::frozen).acquire(a, unit_use::stash).release(a).release(unit_id{l});
      }
      for (std::uint32_t l = layers; l-- > 0;) {
        const unit_id a{layers + l};
        p.acquire(unit_id{l}).acquire(a, unit_use::frozen).release(a).release(unit_id{l});
      }
      std::vector<std::size_t> used;
      for (std::uint32_t u = 0; u < 2 * layers; ++u) { used.push_back(u); }
      in.steps.push_back(used);
      in.ordered.push_back(p);
    }
    const tools::plan_report r = tools::make_plan(in);
    EXPECT_EQ(r.peak_device_bytes, layer + block) << what;  // a layer whole and its block

    const device dev = emulated_device({.memory_bytes = in.options.device.budget, .link = {}});
    runtime rt(dev, in.options, units);
    rt.plan(in.ordered);
    const stream st(dev);
    EXPECT_LE(run_calls(rt, in.ordered, st), in.options.device.budget) << what;
    const step_stats total = rt.stats().total;
    const auto n = static_cast<double>(in.ordered.size());
    // Every stash goes home, beside the layers' write-backs.
    EXPECT_GE(static_cast<double>(total.d2h_bytes), n * layers * static_cast<double>(block)) << what;
    expect_traffic_near(r, total, n, policy == residency::on_demand ? 0.0 : 0.15, what);
    rt.flush();
  }
}
