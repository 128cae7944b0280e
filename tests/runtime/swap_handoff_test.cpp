// SPDX-License-Identifier: Apache-2.0
// A swap-in that takes its victim's extents while the victim's write-back still reads them
// (Note [Handoff], runtime/swap/swap_engine.cpp): neither unit's bytes are lost, against AdamW in
// double precision.

#include "runtime/adamw_reference.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t elements = std::size_t{1} << 20;  // 4 MiB of f32 parameters: 12 MiB written back

// Unit k's initial parameter i: distinct per unit, so a unit's bytes in another's home show.
float initial(std::size_t k, std::size_t i) { return static_cast<float>(k + 1) + static_cast<float>(i % 1000) * 1e-3F; }

// Sets the first `units` units' home parameters to initial().
void fill_homes(runtime& rt, std::uint32_t units)
{
  for (std::uint32_t k = 0; k < units; ++k) {
    const home_view h = rt.home(unit_id{k});
    auto* p = static_cast<float*>(h.master.data);
    for (std::size_t i = 0; i < h.master.count; ++i) { p[i] = initial(k, i); }
  }
}

// One step of unit `u` with every gradient 0.5, stepped on the device.
void train(runtime& rt, unit_id u, stream& s)
{
  const unit_view v = rt.acquire(u, s);
  const slab_view g = v.grads;
  launch_host_func(s, [g] {
    auto* d = static_cast<float*>(g.data);
    for (std::size_t i = 0; i < g.count; ++i) { d[i] = 0.5F; }
  });
  rt.step(u, s);
  rt.release(u, s);
  (void)rt.end_step();
}

// The elements of unit k's home (its first `elements`) that differ from `rounds` AdamW steps of
// gradient 0.5 from initial().
std::size_t off_adamw(runtime& rt, std::uint32_t k, int rounds, const adamw_options& o)
{
  const home_view h = rt.home(unit_id{k});
  const auto* p = static_cast<const float*>(h.master.data);
  const auto* m = static_cast<const float*>(h.m.data);
  const auto* v = static_cast<const float*>(h.v.data);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < elements; ++i) {
    const adamw_state want = adamw_reference(initial(k, i), 0.5, rounds, o);
    const bool near = std::abs(p[i] - want.p) <= 1e-5 * std::abs(want.p) && std::abs(m[i] - want.m) <= 1e-6 &&
                      std::abs(v[i] - want.v) <= 1e-8;
    if (!near) { ++wrong; }
  }
  return wrong;
}

// Three units of one shape in room for two, each trained in turn: every swap-in from the third
// on evicts a unit stepped on the device (written back whole, 12 MiB in 4 MiB parts) and maps
// its extents at the same offsets (2 MiB granules that alias, as CUDA's). Over a 1 GB/s link
// model each part takes about 4 ms, so a copy in that ran ahead of the write-back's part would
// put the incoming unit's bytes in the victim's home.
TEST(swap_handoff, a_swap_in_behind_its_victims_write_back_loses_neither_units_bytes)
{
  const device dev = emulated_device(
    {.memory_bytes = 64 * MiB, .link = {.bytes_per_second = 1e9, .latency_seconds = 0}, .granularity = 2 * MiB});
  std::vector<unit_spec> specs;
  for (int k = 0; k < 3; ++k) {
    unit_spec u;
    u.name = "task/" + std::to_string(k);
    u.tensors = {{"w", {elements}}};
    u.policy = unit_policy{residency::prefetch, 1, optimizer_placement::device};
    specs.push_back(u);
  }
  runtime_options o;
  o.device.budget = 2 * footprint(specs[0], optimizer_placement::device).device_bytes;
  o.optimizer.lr = 1e-2;
  runtime rt(dev, o, specs);
  fill_homes(rt, 3);
  constexpr int rounds = 3;
  std::vector<step_plan> plan;
  for (int r = 0; r < rounds; ++r) {
    for (std::uint32_t k : {0U, 2U, 1U}) { plan.push_back(step_plan{unit_id{k}}); }
  }
  rt.plan(plan);
  stream s(dev);
  for (const step_plan& p : plan) { train(rt, p.entries().front().unit, s); }
  rt.flush();
  // Every swap-in after the first two evicted a stepped unit, written back in parts.
  EXPECT_GE(rt.stats().total.swap_ins, 6U);
  EXPECT_EQ(rt.stats().total.write_backs, rt.stats().total.swap_ins - 2);
  for (std::uint32_t k = 0; k < 3; ++k) {
    const home_view h = rt.home(unit_id{k});
    const auto* p = static_cast<const float*>(h.master.data);
    const auto* m = static_cast<const float*>(h.m.data);
    const auto* v = static_cast<const float*>(h.v.data);
    std::size_t wrong = 0;
    std::size_t first = elements;
    for (std::size_t i = 0; i < elements; ++i) {
      const adamw_state want = adamw_reference(initial(k, i), 0.5, rounds, o.optimizer);
      const bool near = std::abs(p[i] - want.p) <= 1e-5 * std::abs(want.p) && std::abs(m[i] - want.m) <= 1e-6 &&
                        std::abs(v[i] - want.v) <= 1e-8;
      if (!near && wrong++ == 0) { first = i; }
    }
    EXPECT_EQ(wrong, 0U) << "unit " << k << ": " << wrong << " elements differ from AdamW, the first at " << first
                         << " (" << p[first < elements ? first : 0] << ")";
  }
}

// A unit of another shape takes the victim's second extent at another offset: one trained unit
// (4 MiB of parameters, its slot two extents of 2 and 6 granules) and one used frozen (12 MiB of
// parameters: 6 granules) in room for either alone. The frozen use maps the trained unit's 6
// granules at its own offset 0, where the trained unit had them at 4 MiB: part k of its copy
// overwrites what part k + 4 of the write-back reads, so it must wait for the whole write-back
// (device_pool::shares_aligned is false), or the trained unit's home takes its bytes.
TEST(swap_handoff, a_swap_in_that_maps_the_victims_extent_at_another_offset_waits_for_all_of_it)
{
  const device dev = emulated_device(
    {.memory_bytes = 64 * MiB, .link = {.bytes_per_second = 1e9, .latency_seconds = 0}, .granularity = 2 * MiB});
  std::vector<unit_spec> specs(2);
  specs[0].name = "trained";
  specs[0].tensors = {{"w", {elements}}};
  specs[1].name = "frozen";
  specs[1].tensors = {{"w", {3 * elements}}};
  specs[1].trainable = false;  // every use frozen: its slot is its 12 MiB of parameters
  for (unit_spec& u : specs) { u.policy = unit_policy{residency::prefetch, 1, optimizer_placement::device}; }
  runtime_options o;
  o.device.budget = footprint(specs[0], optimizer_placement::device).device_bytes;  // 16 MiB: 8 granules
  o.optimizer.lr = 1e-2;
  runtime rt(dev, o, specs);
  fill_homes(rt, 2);
  constexpr int rounds = 3;
  std::vector<step_plan> plan;
  for (int r = 0; r < rounds; ++r) {
    plan.push_back(step_plan{unit_id{0}});
    plan.push_back(step_plan().acquire(unit_id{1}, unit_use::frozen));
  }
  rt.plan(plan);
  stream s(dev);
  for (int r = 0; r < rounds; ++r) {
    train(rt, unit_id{0}, s);
    (void)rt.acquire(unit_id{1}, s, unit_use::frozen);
    rt.release(unit_id{1}, s);
    (void)rt.end_step();
  }
  rt.flush();
  EXPECT_EQ(rt.stats().total.write_backs, static_cast<std::uint64_t>(rounds));
  EXPECT_EQ(off_adamw(rt, 0, rounds, o.optimizer), 0U) << "elements of the trained unit's home that differ from AdamW";
  const home_view f = rt.home(unit_id{1});
  const auto* q = static_cast<const float*>(f.master.data);
  for (std::size_t i = 0; i < f.master.count; ++i) { ASSERT_EQ(q[i], initial(1, i)) << i; }
}

// A swap-in that follows its victim's write-back but maps only part of its extents leaves the wait
// for the rest to whoever takes them: a trained unit (4 MiB of parameters, its slot two extents of
// 2 and 6 granules) in room for itself alone, then a frozen unit of 4 MiB that takes its first
// extent at the same offset (a handoff) and a frozen unit of 12 MiB that takes its second. The
// second's copy queues on h2d behind the first's, which ends as the write-back has read the
// trained unit's parameters; it must then wait for the write-back of the trained unit's AdamW
// state that the extent still holds, or the trained unit's home takes its bytes.
TEST(swap_handoff, a_swap_in_into_the_rest_of_a_handed_off_victims_extents_waits_for_its_write_back)
{
  const device dev = emulated_device(
    {.memory_bytes = 64 * MiB, .link = {.bytes_per_second = 1e9, .latency_seconds = 0}, .granularity = 2 * MiB});
  std::vector<unit_spec> specs(3);
  specs[0].name = "trained";
  specs[0].tensors = {{"w", {elements}}};
  specs[1].name = "small";
  specs[1].tensors = {{"w", {elements}}};
  specs[2].name = "large";
  specs[2].tensors = {{"w", {3 * elements}}};
  for (unit_spec& u : specs) {
    u.trainable = &u == &specs[0];
    u.policy = unit_policy{residency::prefetch, 1, optimizer_placement::device};
  }
  runtime_options o;
  o.device.budget = footprint(specs[0], optimizer_placement::device).device_bytes;  // 16 MiB: 8 granules
  o.optimizer.lr = 1e-2;
  runtime rt(dev, o, specs);
  fill_homes(rt, 3);
  constexpr int rounds = 3;
  std::vector<step_plan> plan;
  for (int r = 0; r < rounds; ++r) {
    plan.push_back(step_plan{unit_id{0}});
    plan.push_back(step_plan().acquire(unit_id{1}, unit_use::frozen));
    plan.push_back(step_plan().acquire(unit_id{2}, unit_use::frozen));
  }
  rt.plan(plan);
  stream s(dev);
  for (int r = 0; r < rounds; ++r) {
    train(rt, unit_id{0}, s);
    for (std::uint32_t k : {1U, 2U}) {
      (void)rt.acquire(unit_id{k}, s, unit_use::frozen);
      rt.release(unit_id{k}, s);
      (void)rt.end_step();
    }
  }
  rt.flush();
  EXPECT_EQ(rt.stats().total.write_backs, static_cast<std::uint64_t>(rounds));
  EXPECT_EQ(off_adamw(rt, 0, rounds, o.optimizer), 0U) << "elements of the trained unit's home that differ from AdamW";
  for (std::uint32_t k : {1U, 2U}) {
    const home_view f = rt.home(unit_id{k});
    const auto* q = static_cast<const float*>(f.master.data);
    for (std::size_t i = 0; i < f.master.count; ++i) { ASSERT_EQ(q[i], initial(k, i)) << k << " " << i; }
  }
}

}  // namespace
}  // namespace taskswap::test
