// SPDX-License-Identifier: Apache-2.0
// The runtime's protocol, plan, eviction rule, stats and trace on the emulated backend.

#include "expect_error.hpp"
#include "runtime/residency/plan_queue.hpp"
#include "host/cpu_adamw.hpp"
#include "host/stream_stagger.hpp"
#include "numeric/dtype_conversion.hpp"
#include "runtime/units/unit_layout.hpp"
#include "test_scale.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

unit_spec make_unit(std::string name, std::size_t elements, residency r = residency::prefetch,
                    optimizer_placement o = optimizer_placement::device, int lookahead = 2)
{
  unit_spec u;
  u.name = std::move(name);
  u.tensors = {{"w", {elements}}};
  u.policy = unit_policy{r, lookahead, o};
  return u;
}

runtime_options options_with_budget(std::size_t budget)
{
  runtime_options o;
  o.device.budget = budget;
  return o;
}

device emulated(std::size_t memory, double link_bytes_per_second = 0)
{
  return emulated_device({.memory_bytes = memory, .link = {.bytes_per_second = link_bytes_per_second}});
}

// A streamed trunk: a task unit (id 0) and `layers` layer units after it, 1024 parameters each.
std::vector<unit_spec> task_and_layers(std::uint32_t layers)
{
  std::vector<unit_spec> specs{make_unit("task/0", 1024)};
  for (std::uint32_t l = 0; l < layers; ++l) { specs.push_back(make_unit("layer/" + std::to_string(l), 1024)); }
  return specs;
}

constexpr unit_id trunk_layer(std::uint32_t l) { return unit_id{1 + l}; }

// One step of it: the task unit held throughout, the layers' forwards (frozen) in order, then
// their backwards (trained) in reverse.
step_plan streamed_trunk_step(std::uint32_t layers)
{
  step_plan p;
  p.acquire(unit_id{0});
  for (std::uint32_t l = 0; l < layers; ++l) { p.acquire(trunk_layer(l), unit_use::frozen).release(trunk_layer(l)); }
  for (std::uint32_t l = layers; l-- > 0;) { p.acquire(trunk_layer(l)).release(trunk_layer(l)); }
  return p;
}

TEST(unit_layout, slabs_are_aligned_and_the_travelling_prefix_is_shared)
{
  unit_spec u;
  u.name = "u";
  u.tensors = {{"a", {3, 5}}, {"b", {7}}};
  u.compute = dtype::bf16;
  u.grad = dtype::f32;
  const auto d = detail::make_unit_layout(u, optimizer_placement::device);
  ASSERT_EQ(d.tensors.size(), 2U);
  EXPECT_EQ(d.tensors[0].offset, 0U);
  EXPECT_EQ(d.tensors[1].offset, 64U);  // tensors start on 64-element boundaries
  EXPECT_EQ(d.count, 64U + 7U);
  for (const std::size_t off : {d.params, d.master, d.m, d.v, d.device_grads}) { EXPECT_EQ(off % 256, 0U); }
  EXPECT_LT(d.params, d.master);
  EXPECT_EQ(d.travel_bytes, d.device_grads);
  EXPECT_EQ(d.writeback_bytes, d.travel_bytes);
  EXPECT_EQ(d.home_bytes, d.travel_bytes);  // device placement keeps no gradients at home

  const auto h = detail::make_unit_layout(u, optimizer_placement::host);
  EXPECT_EQ(h.travel_bytes, 256U);  // params only: 71 bf16 round up to one 256-byte slab
  EXPECT_EQ(h.writeback_bytes, 0U);
  EXPECT_EQ(h.device_bytes, 256U + 512U);  // params + f32 gradients
  EXPECT_GT(h.home_bytes, h.home_grads);

  unit_spec f = u;
  f.compute = dtype::f32;
  f.grad.reset();
  EXPECT_EQ(detail::make_unit_layout(f, optimizer_placement::device).master, 0U);  // params are the master
}

// The CPU AdamW streams through a host-placed unit's params, master, m, v and home gradients
// together; large slabs must not start a round distance apart (host/stream_stagger.hpp), small
// ones stay back to back, and device placement is never staggered.
TEST(unit_layout, large_host_slabs_start_staggered_and_small_ones_back_to_back)
{
  for (const std::size_t n : {std::size_t{2} << 20, std::size_t{64} << 20, (std::size_t{96} << 20) + 12345}) {
    for (const dtype compute : {dtype::f32, dtype::bf16}) {
      unit_spec u{.name = "big", .tensors = {{"w", {n}}}, .compute = compute, .grad = compute};
      const auto h = detail::make_unit_layout(u, optimizer_placement::host);
      std::vector<std::size_t> starts{h.m, h.v, h.home_grads};
      if (compute != dtype::f32) { starts.push_back(h.master); }
      starts.push_back(h.params);
      for (std::size_t i = 0; i < starts.size(); ++i) {
        EXPECT_EQ(starts[i] % detail::slab_alignment, 0U);
        for (std::size_t j = i + 1; j < starts.size(); ++j) {
          const std::size_t d = starts[i] > starts[j] ? starts[i] - starts[j] : starts[j] - starts[i];
          EXPECT_GE(detail::stagger_score(d), 1.0)
            << "n " << n << " slabs " << i << "," << j << " are " << d << " bytes apart";
        }
      }
      // The slabs do not overlap and the padding is at most one window per staggered slab.
      const std::size_t naive = h.params_bytes + (compute != dtype::f32 ? 3 : 2) * h.state_bytes + h.grad_bytes;
      EXPECT_GE(h.home_bytes, naive);
      EXPECT_LE(h.home_bytes, naive + 4 * detail::stagger_window);
      EXPECT_GE(h.m, h.master + (compute != dtype::f32 ? h.state_bytes : h.params_bytes));
      EXPECT_GE(h.v, h.m + h.state_bytes);
      EXPECT_GE(h.home_grads, h.v + h.state_bytes);
      EXPECT_EQ(h.device_grads, h.params_bytes);  // the device copy is never staggered
      const auto d = detail::make_unit_layout(u, optimizer_placement::device);
      EXPECT_EQ(d.v, d.m + d.state_bytes);
      EXPECT_EQ(d.device_grads, d.v + d.state_bytes);
    }
  }
  unit_spec small{.name = "small", .tensors = {{"w", {std::size_t{1} << 20}}}};  // 4 MiB slabs
  const auto h = detail::make_unit_layout(small, optimizer_placement::host);
  EXPECT_EQ(h.m, h.params_bytes);
  EXPECT_EQ(h.v, h.m + h.state_bytes);
  EXPECT_EQ(h.home_bytes, h.v + h.state_bytes + h.grad_bytes);
}

TEST(unit_layout, adamw_runs_split_where_the_weight_decay_flag_changes_and_cover_the_slab)
{
  unit_spec u;
  u.name = "u";
  u.tensors = {{"w1", {100}}, {"w2", {30}}, {"b1", {7}, true}, {"b2", {5}, true}, {"w3", {3}}};
  const detail::unit_layout l = detail::make_unit_layout(u, optimizer_placement::device);
  ASSERT_EQ(l.runs.size(), 3U);
  EXPECT_EQ(l.runs[0].begin, 0U);
  EXPECT_TRUE(l.runs[0].decay);
  EXPECT_EQ(l.runs[1].begin, l.tensors[2].offset);  // b1 starts the no-decay run, b2 joins it
  EXPECT_FALSE(l.runs[1].decay);
  EXPECT_EQ(l.runs[2].begin, l.tensors[4].offset);
  for (std::size_t i = 0; i + 1 < l.runs.size(); ++i) {
    EXPECT_EQ(l.runs[i].begin + l.runs[i].count, l.runs[i + 1].begin);
  }
  EXPECT_EQ(l.runs.back().begin + l.runs.back().count, l.count);
  EXPECT_TRUE(l.tensors[3].no_weight_decay);
  u.tensors = {{"w", {10}}};
  EXPECT_EQ(detail::make_unit_layout(u, optimizer_placement::host).runs.size(), 1U);
}

// A bf16 unit with a no-decay norm first: its home's slabs start staggered, so the CPU AdamW runs
// the plain loop (Note [Grouped stores]). The big run after the norm, alone, would not look
// staggered (the bf16 slabs move half as far as the f32 ones), which is why host placement judges
// the store order once for the whole unit.
TEST(unit_layout, a_homes_store_order_is_judged_on_the_whole_unit)
{
  const unit_spec u{.name = "layer",
                    .tensors = {{"ln", {4096}, true}, {"w", {std::size_t{8} << 20}}},
                    .compute = dtype::bf16,
                    .grad = dtype::bf16};
  const detail::unit_layout h = detail::make_unit_layout(u, optimizer_placement::host);
  ASSERT_EQ(h.runs.size(), 2U);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast,performance-no-int-to-ptr): addresses only
  auto* const base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
  const detail::adamw_slabs whole = h.slabs_at(base, h.home_grads);
  EXPECT_TRUE(detail::staggered(whole));
  EXPECT_FALSE(detail::grouped_stores(whole));
  EXPECT_FALSE(detail::staggered(h.run_slabs(whole, h.runs[1])));
}

TEST(runtime_registration, a_policy_with_a_bad_lr_scale_or_weight_decay_is_refused)
{
  device dev = emulated(1 * MiB);
  unit_spec u = make_unit("a", 64);
  u.policy->lr_scale = -1;
  expect_error_mentioning<config_error>([&] { runtime rt(dev, options_with_budget(1 * MiB), {u}); },
                                        "unit 'a': lr_scale -1 must be more than 0");
  u.policy->lr_scale = 1;
  u.policy->weight_decay = -0.5;
  expect_error_mentioning<config_error>([&] { runtime rt(dev, options_with_budget(1 * MiB), {u}); },
                                        "unit 'a': weight_decay -0.5 must be 0 or more");
}

TEST(unit_layout, refuses_units_without_tensors_or_with_empty_dimensions)
{
  unit_spec u;
  u.name = "empty";
  expect_error_mentioning<config_error>([&] { (void)detail::make_unit_layout(u, optimizer_placement::device); },
                                        "has no tensors");
  u.tensors = {{"w", {4, 0}}};
  expect_error_mentioning<config_error>([&] { (void)detail::make_unit_layout(u, optimizer_placement::device); },
                                        "dimension of 0");
}

TEST(plan_queue, next_use_follows_consumption_and_skipped_acquisitions_are_dropped)
{
  detail::plan_queue q(3);
  const unit_id a{0}, b{1}, c{2};
  q.append(step_plan{a, b});
  const std::vector<std::uint32_t> reduced{0};
  q.append(step_plan{}.acquire(c, unit_use::frozen).acquire(a, unit_use::frozen), reduced);
  EXPECT_EQ(q.next_use(a), 0U);
  EXPECT_EQ(q.next_use(b), 1U);
  EXPECT_EQ(q.next_use(c), 2U);
  EXPECT_EQ(q.step_distance(3), 1U);
  EXPECT_EQ(q.use_at(1), detail::planned_use::train);
  EXPECT_EQ(q.use_at(2), detail::planned_use::frozen);
  EXPECT_EQ(q.use_at(3), detail::planned_use::frozen_reduced);
  EXPECT_EQ(q.peek(b)->position, 1U);
  EXPECT_EQ(q.match(b)->position, 1U);  // out of order within the step is still planned
  EXPECT_EQ(q.peek(b), std::nullopt);  // consumed
  EXPECT_EQ(q.match(c), std::nullopt);  // c belongs to the next step
  q.end_step();  // a's acquisition in step 0 was skipped
  EXPECT_EQ(q.next_use(a), 3U);
  EXPECT_EQ(q.use_at(q.next_use(a)), detail::planned_use::frozen_reduced);
  EXPECT_EQ(q.next_use(b), detail::never);
  std::vector<std::uint64_t> seen;
  std::vector<detail::planned_use> uses;
  q.for_each_upcoming(5, [&](unit_id, detail::planned_acquisition p, std::size_t) {
    seen.push_back(p.position);
    uses.push_back(p.use);
    return true;
  });
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{2, 3}));
  // c is used frozen; a is used frozen while other ranks train it (whole, for their update)
  EXPECT_EQ(uses, (std::vector<detail::planned_use>{detail::planned_use::frozen, detail::planned_use::frozen_reduced}));
  EXPECT_FALSE(q.peek(c)->whole());
  EXPECT_TRUE(q.peek(a)->whole());
}

TEST(plan_queue, dropping_a_units_uses_leaves_the_rest_of_the_step_and_the_next_steps)
{
  detail::plan_queue q(3);
  const unit_id a{0}, b{1}, c{2};
  q.append(step_plan{}.acquire(a, unit_use::frozen).release(a).acquire(b).acquire(a).acquire(c));
  q.append(step_plan{a});
  EXPECT_EQ(q.match(a)->position, 0U);
  EXPECT_EQ(q.drop(c), 1U);
  EXPECT_EQ(q.drop(c), 0U);  // nothing left of c in this step
  EXPECT_EQ(q.next_use(c), detail::never);
  EXPECT_EQ(q.drop(a), 1U);  // its second use in this step; the next step's stays
  EXPECT_EQ(q.next_use(a), 4U);
  EXPECT_EQ(q.peek(a), std::nullopt);
  std::vector<std::uint64_t> seen;
  q.for_each_upcoming(1, [&](unit_id, detail::planned_acquisition p, std::size_t) {
    seen.push_back(p.position);
    return true;
  });
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{1, 4}));
  EXPECT_EQ(q.match(b)->position, 1U);
  q.end_step();
  EXPECT_EQ(q.match(a)->position, 4U);
}

// The fewest fetches any eviction choice achieves, by dynamic programming over cache contents.
std::size_t optimal_fetches(const std::vector<std::uint32_t>& requests, std::size_t units, std::size_t capacity)
{
  constexpr std::size_t inf = 1U << 30;
  std::map<std::uint32_t, std::size_t> best{{0U, 0U}};
  for (const std::uint32_t r : requests) {
    std::map<std::uint32_t, std::size_t> next;
    const auto relax = [&](std::uint32_t set, std::size_t cost) {
      auto [it, inserted] = next.try_emplace(set, cost);
      if (!inserted) { it->second = std::min(it->second, cost); }
    };
    for (const auto& [set, cost] : best) {
      const std::uint32_t bit = 1U << r;
      if ((set & bit) != 0) {
        relax(set, cost);
      } else if (static_cast<std::size_t>(std::popcount(set)) < capacity) {
        relax(set | bit, cost + 1);
      } else {
        for (std::uint32_t v = 0; v < units; ++v) {
          if ((set & (1U << v)) != 0) { relax((set & ~(1U << v)) | bit, cost + 1); }
        }
      }
    }
    best = std::move(next);
  }
  std::size_t result = inf;
  for (const auto& [set, cost] : best) { result = std::min(result, cost); }
  return result;
}

TEST(runtime_eviction, belady_fetches_as_few_units_as_a_brute_force_optimum)
{
  const std::size_t cases = large_case(400, 60);
  std::mt19937_64 rng(7);
  for (std::size_t c = 0; c < cases; ++c) {
    const std::size_t units = 2 + rng() % 4;
    const std::size_t capacity = 1 + rng() % (units - 1);
    std::vector<std::uint32_t> requests(1 + rng() % 10);
    for (auto& r : requests) { r = static_cast<std::uint32_t>(rng() % units); }
    for (const residency policy : {residency::on_demand, residency::prefetch}) {
      std::vector<unit_spec> specs;
      for (std::size_t u = 0; u < units; ++u) {
        // Not "u" + std::to_string(u): GCC 12 at -O3 reports a false -Wrestrict in std::string's
        // insert for a short literal plus a temporary (GCC bug 105651).
        std::string name = "u";
        name += std::to_string(u);
        specs.push_back(make_unit(name, 64, policy, optimizer_placement::host, 1000));
      }
      const std::size_t unit_bytes = 512;  // 64 f32 params + 64 f32 grads
      device dev = emulated(capacity * unit_bytes);
      runtime rt(dev, options_with_budget(capacity * unit_bytes), specs);
      ASSERT_EQ(rt.device_bytes(unit_id{0}), unit_bytes);
      std::vector<step_plan> plan;
      for (const std::uint32_t r : requests) { plan.push_back(step_plan{unit_id{r}}); }
      rt.plan(plan);
      stream s(dev);
      for (const std::uint32_t r : requests) {
        (void)rt.acquire(unit_id{r}, s);
        rt.release(unit_id{r}, s);
        (void)rt.end_step();
      }
      EXPECT_EQ(rt.stats().total.swap_ins, optimal_fetches(requests, units, capacity))
        << "case " << c << ", policy " << to_string(policy);
    }
  }
}

TEST(runtime_protocol, acquire_does_not_wait_for_the_swap_in_and_the_stall_is_measured)
{
  // 10 MB/s: the 512 KiB swap-in takes about 52 ms on the h2d stream.
  device dev = emulated(8 * MiB, 10e6);
  runtime rt(dev, options_with_budget(8 * MiB),
             {make_unit("task/0", 128 * KiB, residency::on_demand, optimizer_placement::host)});
  stream s(dev);
  const unit_id u = rt.find("task/0");
  (void)rt.acquire(u, s);
  EXPECT_FALSE(s.query()) << "the compute stream should still be waiting for the swap-in";
  EXPECT_EQ(rt.state(u), unit_state::held);
  rt.release(u, s);
  s.synchronize();
  const step_stats st = rt.end_step();
  EXPECT_EQ(st.misses, 1U);
  EXPECT_EQ(st.unplanned, 1U);
  EXPECT_EQ(st.h2d_bytes, 512 * KiB);
  rt.flush();
  EXPECT_GT(rt.stats().steps.back().stall_ms, 30.0);
}

TEST(runtime_protocol, prefetch_brings_the_next_steps_units_in_before_they_are_acquired)
{
  device dev = emulated(64 * MiB);
  std::vector<unit_spec> specs;
  for (int i = 0; i < 4; ++i) { specs.push_back(make_unit("task/" + std::to_string(i), 1024)); }
  runtime rt(dev, options_with_budget(64 * MiB), specs);
  rt.plan(
    std::vector<step_plan>{step_plan{unit_id{0}}, step_plan{unit_id{1}}, step_plan{unit_id{2}}, step_plan{unit_id{3}}});
  // Lookahead 2: steps 0, 1 and 2 are in flight, step 3 is not yet.
  EXPECT_EQ(rt.state(unit_id{2}), unit_state::resident);
  EXPECT_EQ(rt.state(unit_id{3}), unit_state::home);
  stream s(dev);
  for (std::uint32_t k = 0; k < 4; ++k) {
    (void)rt.acquire(unit_id{k}, s);
    rt.release(unit_id{k}, s);
    const step_stats st = rt.end_step();
    EXPECT_EQ(st.hits, 1U);
    EXPECT_EQ(st.misses, 0U);
  }
}

// Room for three units, four used once each. When step 1 releases its unit, the prefetch of
// step 3's unit must evict one: units 0, 1 and 2 are all used never again after step 3 (a tie
// for Belady). Unit 2 is needed first (step 2) and was never released, so it is the least
// recently released; a unit idle until step 3 (0, released first) is the one Belady takes when
// step 3 comes, so the prefetch goes ahead instead of waiting for a tie it could break.
TEST(runtime_protocol, a_prefetch_is_not_held_back_by_a_tie_with_a_unit_needed_first)
{
  device dev = emulated(64 * MiB);
  std::vector<unit_spec> specs;
  for (int i = 0; i < 4; ++i) { specs.push_back(make_unit("task/" + std::to_string(i), 1024)); }
  const std::size_t slot = footprint(specs[0], optimizer_placement::device).device_bytes;
  runtime rt(dev, options_with_budget(3 * slot), specs);
  rt.plan(
    std::vector<step_plan>{step_plan{unit_id{0}}, step_plan{unit_id{1}}, step_plan{unit_id{2}}, step_plan{unit_id{3}}});
  stream s(dev);
  for (std::uint32_t k = 0; k < 2; ++k) {
    (void)rt.acquire(unit_id{k}, s);
    rt.release(unit_id{k}, s);
    (void)rt.end_step();
  }
  EXPECT_EQ(rt.state(unit_id{3}), unit_state::resident) << "step 3's unit was not prefetched during step 1";
  EXPECT_EQ(rt.state(unit_id{2}), unit_state::resident);
  EXPECT_EQ(rt.state(unit_id{0}), unit_state::home);
  for (std::uint32_t k = 2; k < 4; ++k) {
    (void)rt.acquire(unit_id{k}, s);
    rt.release(unit_id{k}, s);
    const step_stats st = rt.end_step();
    EXPECT_EQ(st.misses, 0U);
  }
  EXPECT_EQ(rt.stats().total.swap_ins, 4U);  // every unit fetched once: the prefetch added none
}

// Room for three units, lookahead 1 (so the victim rule ranks by next use only within one step
// past the use the room is for). Steps use units 1, 2, 0, 3, 1, 2, 0. At the end of step 1 the
// prefetch of step 3's unit 3 needs room among units 1 (next used at step 4: within the horizon),
// 2 (step 5) and 0 (step 6, needed first at step 2). Belady's rule would take unit 0 and wait for
// its release at the end of step 2, leaving the swap-in only the time between two steps. Units 2
// and 0 both lie beyond the horizon, and unit 2 is idle: it goes now (Note [Victims beyond the
// lookahead]); unit 1, the least recently released but within the horizon, stays.
TEST(runtime_protocol, a_prefetch_takes_an_idle_unit_beyond_the_lookahead_before_the_unit_needed_first)
{
  device dev = emulated(64 * MiB);
  std::vector<unit_spec> specs;
  for (int i = 0; i < 4; ++i) {
    specs.push_back(make_unit("task/" + std::to_string(i), 1024, residency::prefetch, optimizer_placement::device, 1));
  }
  const std::size_t slot = footprint(specs[0], optimizer_placement::device).device_bytes;
  runtime rt(dev, options_with_budget(3 * slot), specs);
  const std::vector<std::uint32_t> order{1, 2, 0, 3, 1, 2, 0};
  std::vector<step_plan> plan;
  for (const std::uint32_t u : order) { plan.push_back(step_plan{unit_id{u}}); }
  rt.plan(plan);
  stream s(dev);
  for (std::size_t k = 0; k < order.size(); ++k) {
    const unit_id u{order[k]};
    (void)rt.acquire(u, s);
    rt.release(u, s);
    const step_stats st = rt.end_step();
    EXPECT_EQ(st.misses, 0U) << "step " << k;
    if (k == 1) {
      EXPECT_EQ(rt.state(unit_id{3}), unit_state::resident) << "step 3's unit waited for unit 0";
      EXPECT_EQ(rt.state(unit_id{2}), unit_state::home);
      EXPECT_EQ(rt.state(unit_id{1}), unit_state::resident);
      EXPECT_EQ(rt.state(unit_id{0}), unit_state::resident);
    }
  }
}

// A streamed trunk: the step's task unit is held to its end and never used again in the plan, so
// Belady ranks it the best victim; it cannot be evicted, and an in-step prefetch that waited for
// it (as one for a later step rightly does) would never run. Each layer must be brought in while
// the one before it is in use (Note [Prefetch victims]).
TEST(runtime_protocol, stream_prefetches_the_next_layer_past_a_unit_held_to_the_end)
{
  device dev = emulated(64 * MiB);
  constexpr std::uint32_t layers = 8;
  const std::vector<unit_spec> specs = task_and_layers(layers);
  const std::size_t slot = footprint(specs[0], optimizer_placement::device).device_bytes;
  runtime rt(dev, options_with_budget(3 * slot), specs);  // the task unit and two layers
  const auto layer = trunk_layer;
  const step_plan plan_step = streamed_trunk_step(layers);
  rt.plan(std::vector<step_plan>{plan_step, plan_step});
  stream s(dev);
  for (int step = 0; step < 2; ++step) {
    (void)rt.acquire(unit_id{0}, s);
    for (std::uint32_t l = 0; l < layers; ++l) {
      (void)rt.acquire(layer(l), s, unit_use::frozen);
      if (l + 1 < layers) {
        EXPECT_NE(rt.state(layer(l + 1)), unit_state::home)
          << "step " << step << ": layer " << l + 1 << " was not prefetched while layer " << l << " is held";
      }
      rt.release(layer(l), s);
    }
    for (std::uint32_t l = layers; l-- > 0;) {
      (void)rt.acquire(layer(l), s);
      rt.step(layer(l), s);
      rt.release(layer(l), s);
    }
    rt.release(unit_id{0}, s);
    const step_stats st = rt.end_step();
    EXPECT_LE(st.misses, step == 0 ? 2U : 0U) << "step " << step;  // the first step's first uses may miss
    EXPECT_LE(st.peak_device_bytes, 3 * slot);
  }
}

// The turn of a streamed trunk: the last layer's backward follows its forward at once. Its whole
// slot (parameters, gradients, optimizer state) must be on its way before the forward: the unit
// coming in is not a candidate to make its own room (its slot is counted as freed), or Belady
// would pick it, needed for the forward first, and the prefetch would wait for its release.
TEST(runtime_protocol, the_last_layer_comes_in_whole_before_its_forward_when_its_backward_follows)
{
  device dev = emulated(64 * MiB);
  constexpr std::uint32_t layers = 6;
  const std::vector<unit_spec> specs = task_and_layers(layers);
  const std::size_t slot = footprint(specs[0], optimizer_placement::device).device_bytes;
  runtime rt(dev, options_with_budget(4 * slot), specs);  // the task unit and three whole layers
  const auto layer = trunk_layer;
  const step_plan plan_step = streamed_trunk_step(layers);
  rt.plan(std::vector<step_plan>{plan_step, plan_step, plan_step});
  stream s(dev);
  const auto swap_ins = [&](unit_id u) { return rt.stats().units[u.value].swap_ins; };
  for (int step = 0; step < 3; ++step) {
    (void)rt.acquire(unit_id{0}, s);
    std::size_t before_forward = 0;
    for (std::uint32_t l = 0; l < layers; ++l) {
      if (l + 1 == layers) { before_forward = swap_ins(layer(l)); }
      (void)rt.acquire(layer(l), s, unit_use::frozen);
      rt.release(layer(l), s);
    }
    const std::size_t at_backward = swap_ins(layer(layers - 1));
    for (std::uint32_t l = layers; l-- > 0;) {
      (void)rt.acquire(layer(l), s);
      rt.step(layer(l), s);
      rt.release(layer(l), s);
    }
    rt.release(unit_id{0}, s);
    const step_stats st = rt.end_step();
    EXPECT_EQ(at_backward, before_forward)
      << "step " << step << ": the last layer's whole slot was fetched only after its forward";
    EXPECT_LE(st.peak_device_bytes, 4 * slot);
  }
}

// An early exit: the second step runs 3 of 8 layers. Their forward and backward uses of the layers
// it skips stay in the plan ahead of the backward ones until the step ends, and the prefetch keeps
// room for them: each backward acquisition misses. skip() drops them as the forward leaves.
TEST(runtime_protocol, skip_gives_a_skipped_layers_room_to_the_backward_of_an_early_exit)
{
  constexpr std::uint32_t layers = 8;
  constexpr std::uint32_t depth = 3;
  const auto run = [&](bool skip) {
    device dev = emulated(64 * MiB);
    const std::vector<unit_spec> specs = task_and_layers(layers);
    const std::size_t slot = footprint(specs[0], optimizer_placement::device).device_bytes;
    runtime rt(dev, options_with_budget(3 * slot), specs);  // the task unit and two layers
    const auto layer = trunk_layer;
    const step_plan p = streamed_trunk_step(layers);
    rt.plan(std::vector<step_plan>{p, p, p});
    stream s(dev);
    std::vector<step_stats> steps;
    for (int step = 0; step < 3; ++step) {
      const std::uint32_t run_layers = step == 1 ? depth : layers;
      (void)rt.acquire(unit_id{0}, s);
      for (std::uint32_t l = 0; l < run_layers; ++l) {
        (void)rt.acquire(layer(l), s, unit_use::frozen);
        rt.release(layer(l), s);
      }
      if (skip) {
        std::vector<unit_id> skipped;
        for (std::uint32_t l = layers; l-- > run_layers;) { skipped.push_back(layer(l)); }
        rt.skip(skipped);
      }
      for (std::uint32_t l = run_layers; l-- > 0;) {
        (void)rt.acquire(layer(l), s);
        rt.step(layer(l), s);
        rt.release(layer(l), s);
      }
      rt.release(unit_id{0}, s);
      steps.push_back(rt.end_step());
      EXPECT_LE(steps.back().peak_device_bytes, 3 * slot);
    }
    EXPECT_EQ(rt.stats().total.unplanned, 0U);
    return steps;
  };
  const std::vector<step_stats> planned_only = run(false);
  EXPECT_EQ(planned_only[1].misses, depth);  // every backward acquisition of the early exit
  const std::vector<step_stats> skipped = run(true);
  EXPECT_EQ(skipped[1].misses, 0U);
  EXPECT_EQ(skipped[2].misses, 0U);  // and the next step's prefetch is where it was
}

TEST(runtime_protocol, protocol_errors_say_what_to_do)
{
  device dev = emulated(1 * MiB);
  runtime rt(dev, options_with_budget(1 * MiB), {make_unit("a", 256), make_unit("b", 256)});
  stream s(dev);
  const unit_id a = rt.find("a");
  expect_error_mentioning<invalid_argument>([&] { rt.release(a, s); }, "call acquire first");
  expect_error_mentioning<invalid_argument>([&] { rt.step(a, s); }, "call acquire first");
  (void)rt.acquire(a, s);
  expect_error_mentioning<invalid_argument>([&] { (void)rt.acquire(a, s); }, "already held");
  expect_error_mentioning<invalid_argument>([&] { (void)rt.end_step(); }, "'a' is still held");
  expect_error_mentioning<invalid_argument>([&] { rt.flush(); }, "is held; release it first");
  rt.skip(a);  // held, but nothing planned ahead: nothing to drop
  rt.release(a, s);
  (void)rt.end_step();
  rt.plan(step_plan{}.acquire(a).release(a).acquire(a));
  (void)rt.acquire(a, s);
  expect_error_mentioning<invalid_argument>([&] { rt.skip(a); }, "is held; release it first");
  rt.release(a, s);
  rt.skip(a);  // its second use
  EXPECT_EQ(rt.end_step().unplanned, 0U);
  // A held unit among those skipped: refused before any is changed; a unit named twice is fine.
  const unit_id b = rt.find("b");
  rt.plan(step_plan{}.acquire(b).release(b).acquire(a).acquire(b));
  (void)rt.acquire(b, s);
  const std::array<unit_id, 2> both{a, b};
  expect_error_mentioning<invalid_argument>([&] { rt.skip(both); }, "'b'): the unit is held");
  rt.release(b, s);
  (void)rt.acquire(a, s);  // still planned: the refused skip dropped nothing
  const std::array<unit_id, 2> twice{b, b};
  rt.skip(twice);
  rt.release(a, s);
  EXPECT_EQ(rt.end_step().unplanned, 0U);
  expect_error_mentioning<invalid_argument>([&] { (void)rt.find("c"); }, "no unit is named 'c'");
  expect_error_mentioning<invalid_argument>([&] { rt.write_trace("/tmp/x.json"); }, "trace = true");
}

// Writes `values` into a unit's gradient slab (f32) on `s`, and waits: `values` may be a temporary.
void write_grads(const device& dev, const unit_view& v, const std::vector<float>& values, stream_view s)
{
  copy_async(device_span(&dev.backend(), static_cast<std::byte*>(v.grads.data), v.grads.bytes()),
             std::as_bytes(std::span(values)), s);
  s.synchronize();
}

TEST(runtime_frozen, a_frozen_use_brings_the_parameters_alone_and_the_next_step_may_train_the_unit)
{
  device dev = emulated(1 * MiB);
  // Lookahead 0: the prefetch sees only the current step (with more, the next step's training
  // use would bring the unit in whole already).
  const unit_spec spec = make_unit("a", 1024, residency::prefetch, optimizer_placement::device, 0);
  const unit_footprint fp = footprint(spec, optimizer_placement::device);
  EXPECT_EQ(fp.frozen_device_bytes, 4 * KiB);
  EXPECT_EQ(fp.frozen_swap_in_bytes, 4 * KiB);
  EXPECT_EQ(fp.device_bytes, 16 * KiB);
  runtime rt(dev, options_with_budget(1 * MiB), {spec});
  stream s(dev);
  const unit_id a{0};
  rt.plan(std::vector<step_plan>{step_plan{}.acquire(a, unit_use::frozen), step_plan{a},
                                 step_plan{}.acquire(a, unit_use::frozen)});
  EXPECT_EQ(rt.stats().device_bytes_in_use, 4 * KiB) << "the frozen use's prefetch brings the parameters alone";
  const unit_view v = rt.acquire(a, s, unit_use::frozen);
  EXPECT_TRUE(v.frozen);
  EXPECT_EQ(v.grads.data, nullptr);
  expect_error_mentioning<invalid_argument>([&] { (void)v.grad(0); }, "used frozen");
  expect_error_mentioning<invalid_argument>([&] { rt.grads_ready(a, s); }, "used frozen");
  expect_error_mentioning<invalid_argument>([&] { rt.step(a, s); }, "used frozen");
  rt.release(a, s);
  step_stats st = rt.end_step();
  EXPECT_EQ(st.frozen, 1U);
  EXPECT_EQ(st.h2d_bytes, 4 * KiB);
  EXPECT_EQ(st.write_backs, 0U);
  // Trained in the next step: it comes in whole (its optimizer state and a zeroed gradient slab).
  const unit_view t = rt.acquire(a, s);
  EXPECT_FALSE(t.frozen);
  write_grads(dev, t, std::vector<float>(1024, 0.5F), s);
  rt.step(a, s);
  rt.release(a, s);
  st = rt.end_step();
  EXPECT_EQ(st.misses + st.hits, 1U);
  // Frozen again: the whole slot stays while there is room; nothing is written home for it.
  (void)rt.acquire(a, s, unit_use::frozen);
  rt.release(a, s);
  st = rt.end_step();
  EXPECT_EQ(st.hits, 1U);
  EXPECT_EQ(st.d2h_bytes, 0U);
  rt.flush();
  EXPECT_EQ(rt.home(a).step, 1);
  // Without a communicator a use other than the planned one is an unplanned acquisition.
  rt.plan(step_plan{}.acquire(a, unit_use::frozen));
  (void)rt.acquire(a, s);
  rt.release(a, s);
  EXPECT_EQ(rt.end_step().unplanned, 1U);
}

TEST(runtime_views, tensor_views_carry_bytes_dtype_and_shape_and_take_copies)
{
  device dev = emulated(1 * MiB);
  unit_spec spec;
  spec.name = "a";
  spec.tensors = {{"w", {3, 5}}, {"b", {7}}};
  spec.compute = dtype::bf16;
  spec.grad = dtype::f32;
  runtime rt(dev, options_with_budget(1 * MiB), {spec});
  stream s(dev);
  const unit_view v = rt.acquire(unit_id{0}, s);
  const tensor_view w = v.param_tensor(0);
  EXPECT_EQ(w.type, dtype::bf16);
  EXPECT_EQ(std::vector<std::size_t>(w.shape.begin(), w.shape.end()), (std::vector<std::size_t>{3, 5}));
  EXPECT_EQ(w.count, 15U);
  EXPECT_EQ(w.memory.size(), 30U);
  EXPECT_EQ(static_cast<void*>(w.data<std::uint16_t>()), v.param(0));
  expect_error_mentioning<invalid_argument>([&] { (void)w.data<float>(); }, "the tensor is bf16; use std::uint16_t");
  const tensor_view g = v.grad_tensor(1);
  EXPECT_EQ(g.type, dtype::f32);
  EXPECT_EQ(g.count, 7U);
  EXPECT_EQ(static_cast<void*>(g.data<float>()), v.grad(1));
  // The span is the device's memory: copies take it without reaching into the backend.
  const std::vector<float> ones(7, 1.0F);
  copy_async(g.memory, std::as_bytes(std::span(ones)), s);
  std::vector<float> back(7, 0.0F);
  copy_async(std::as_writable_bytes(std::span(back)), g.memory, s);
  s.synchronize();
  EXPECT_EQ(back, ones);
  expect_error_mentioning<invalid_argument>([&] { (void)v.param_tensor(2); }, "tensor 2 of a unit with 2");
  rt.release(unit_id{0}, s);
  (void)rt.end_step();
  const unit_view f = rt.acquire(unit_id{0}, s, unit_use::frozen);
  expect_error_mentioning<invalid_argument>([&] { (void)f.grad_tensor(0); }, "used frozen");
  rt.release(unit_id{0}, s);
  (void)rt.end_step();
}

// Runs three steps of two units (a trained, then a frozen beside b trained, then both trained)
// and returns their home slabs.
std::vector<std::vector<std::byte>> train_a_then_freeze_it(std::size_t budget, step_stats* second)
{
  device dev = emulated(1 * MiB);
  runtime rt(dev, options_with_budget(budget), {make_unit("a", 1024), make_unit("b", 1024)});
  stream s(dev);
  const unit_id a{0}, b{1};
  rt.plan(std::vector<step_plan>{step_plan{a}, step_plan{}.acquire(a, unit_use::frozen).acquire(b), step_plan{b}});
  const std::vector<float> g(1024, 0.25F);
  unit_view v = rt.acquire(a, s);
  write_grads(dev, v, g, s);
  rt.step(a, s);
  rt.release(a, s);
  (void)rt.end_step();
  (void)rt.acquire(a, s, unit_use::frozen);  // resident whole and dirty
  v = rt.acquire(b, s);  // needs the room beyond a's parameters
  EXPECT_LE(rt.stats().device_bytes_in_use, budget);
  write_grads(dev, v, g, s);
  rt.step(b, s);
  rt.release(b, s);
  rt.release(a, s);
  *second = rt.end_step();
  v = rt.acquire(b, s);
  write_grads(dev, v, g, s);
  rt.step(b, s);
  rt.release(b, s);
  (void)rt.end_step();
  rt.flush();
  EXPECT_LE(rt.stats().total.peak_device_bytes, budget);
  std::vector<std::vector<std::byte>> homes;
  for (const unit_id u : {a, b}) {
    const home_view h = rt.home(u);
    const auto* p = static_cast<const std::byte*>(h.master.data);
    homes.emplace_back(p, p + 3 * h.master.bytes());  // master | m | v, back to back for a small f32 unit
    EXPECT_EQ(h.step, u == a ? 1 : 2);
  }
  return homes;
}

TEST(runtime_frozen, a_whole_unit_held_frozen_gives_up_all_but_its_parameters_when_the_room_is_needed)
{
  // The plan check counts a's frozen use at its 4 KiB of parameters: 4 + 16 KiB fit a 20 KiB
  // budget. a is resident whole and dirty from step 0, so b's acquire narrows it: a's state is
  // written home first and the freed 12 KiB go to b.
  step_stats tight{};
  step_stats roomy{};
  const auto narrowed = train_a_then_freeze_it(20 * KiB, &tight);
  const auto kept = train_a_then_freeze_it(1 * MiB, &roomy);
  EXPECT_EQ(tight.write_backs, 1U);
  EXPECT_EQ(tight.d2h_bytes, 12 * KiB);
  EXPECT_EQ(roomy.write_backs, 0U);
  EXPECT_EQ(narrowed, kept) << "narrowing changed a unit's state";
}

TEST(runtime_optimizer, set_optimizer_refuses_what_the_config_loader_refuses_and_keeps_the_old_values)
{
  device dev = emulated(1 * MiB);
  runtime rt(dev, options_with_budget(1 * MiB), {make_unit("a", 256)});
  EXPECT_EQ(rt.rank(), 0);
  EXPECT_EQ(rt.world_size(), 1);
  rt.set_optimizer({.lr = 2e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1});
  const adamw_options good = rt.optimizer();
  EXPECT_EQ(good.lr, 2e-3);
  EXPECT_EQ(good.beta2, 0.95);
  const auto refused = [&](adamw_options o, const char* text) {
    expect_error_mentioning<config_error>([&] { rt.set_optimizer(o); }, text);
    EXPECT_EQ(rt.optimizer().lr, good.lr);
    EXPECT_EQ(rt.optimizer().weight_decay, good.weight_decay);
  };
  refused({.lr = 0}, "set_optimizer: lr is 0: must be a positive number; nothing was changed");
  refused({.lr = -1e-3}, "lr is -0.001");
  refused({.eps = 0}, "eps is 0");
  refused({.beta1 = 1.0}, "betas are (1, 0.999): each beta must be in [0, 1)");
  refused({.beta2 = -0.5}, "betas");
  refused({.weight_decay = -0.01}, "weight_decay is -0.01: must be 0 or more");
  refused({.lr = std::numeric_limits<double>::infinity()}, "lr is inf");
}

TEST(runtime_registration, a_unit_that_can_never_fit_is_refused_with_the_numbers)
{
  device dev = emulated(1 * MiB);
  std::vector<unit_spec> specs{make_unit("trunk/0", 16 * KiB, residency::pinned), make_unit("task/7", 200 * KiB)};
  expect_error_mentioning<config_error>([&] { runtime rt(dev, options_with_budget(1 * MiB), specs); },
                                        "unit 'task/7' needs 3.1 MiB (3276800 bytes) of device memory but the budget "
                                        "leaves 768.0 KiB (786432 bytes) after pinned units; raise [device] budget or "
                                        "choose optimizer = \"host\"");
  specs[1].name = "trunk/0";
  expect_error_mentioning<config_error>([&] { runtime rt(dev, options_with_budget(1 * MiB), specs); },
                                        "registered twice");
  expect_error_mentioning<config_error>([&] { runtime rt(dev, options_with_budget(1 * MiB), {}); }, "no units given");
}

TEST(runtime_registration, rules_apply_in_order_and_a_rule_matching_nothing_is_an_error)
{
  device dev = emulated(1 * MiB);
  runtime_options o = options_with_budget(1 * MiB);
  o.units.push_back({"trunk/*", residency::pinned, std::nullopt, std::nullopt, "cfg.toml:7"});
  o.units.push_back({"task/*", std::nullopt, 5, optimizer_placement::host, "cfg.toml:11"});
  o.units.push_back({"task/1", residency::on_demand, std::nullopt, std::nullopt, "cfg.toml:15"});
  std::vector<unit_spec> specs;
  for (const char* n : {"trunk/0", "task/0", "task/1"}) {
    unit_spec u = make_unit(n, 64);
    u.policy.reset();
    specs.push_back(u);
  }
  runtime rt(dev, o, specs);
  EXPECT_EQ(rt.policy(rt.find("trunk/0")).residency, residency::pinned);
  EXPECT_EQ(rt.policy(rt.find("task/0")).lookahead, 5);
  EXPECT_EQ(rt.policy(rt.find("task/0")).optimizer, optimizer_placement::host);
  EXPECT_EQ(rt.policy(rt.find("task/1")).residency, residency::on_demand);
  EXPECT_EQ(rt.policy(rt.find("task/1")).optimizer, optimizer_placement::host);

  o.units.push_back({"head/*", residency::pinned, std::nullopt, std::nullopt, "cfg.toml:19"});
  expect_error_mentioning<config_error>([&] { runtime bad(dev, o, specs); },
                                        "cfg.toml:19: [[units]] match = \"head/*\" matches no registered unit");
}

TEST(runtime_plan, a_step_that_holds_more_than_the_budget_is_refused_naming_the_step)
{
  device dev = emulated(1 * MiB);
  std::vector<unit_spec> specs{make_unit("a", 16 * KiB), make_unit("b", 16 * KiB)};  // 256 KiB each
  runtime rt(dev, options_with_budget(400 * KiB), specs);
  const unit_id a{0}, b{1};
  rt.plan(step_plan{a});
  expect_error_mentioning<config_error>(
    [&] {
      rt.plan(step_plan{a, b});
    },
    "plan step 1: after acquiring 'b' the units held at once ('a', 'b') take "
    "512.0 KiB");
  // Released in between, the same two fit one after the other.
  step_plan streamed;
  streamed.acquire(a).release(a).acquire(b).release(b);
  rt.plan(streamed);
  expect_error_mentioning<config_error>([&] { rt.plan(step_plan().release(a)); }, "has not acquired");
}

TEST(runtime_plan, a_step_off_its_plan_that_cannot_fit_fails_with_out_of_memory_and_loses_nothing)
{
  device dev = emulated(1 * MiB);
  std::vector<unit_spec> specs{make_unit("a", 16 * KiB), make_unit("b", 16 * KiB)};
  runtime rt(dev, options_with_budget(400 * KiB), specs);
  stream s(dev);
  (void)rt.acquire(unit_id{0}, s);
  expect_error_mentioning<out_of_memory>([&] { (void)rt.acquire(unit_id{1}, s); }, "acquire('b') needs 256.0 KiB");
  rt.step(unit_id{0}, s);
  rt.release(unit_id{0}, s);
  (void)rt.end_step();
  (void)rt.acquire(unit_id{1}, s);  // a is evicted (written back) to make room
  rt.release(unit_id{1}, s);
  (void)rt.end_step();
  rt.flush();
  EXPECT_EQ(rt.home(unit_id{0}).step, 1);
  EXPECT_EQ(rt.stats().units[0].write_backs, 1U);
}

TEST(runtime_stats, bytes_and_residency_are_reported_per_step_and_per_unit)
{
  device dev = emulated(4 * MiB);
  std::vector<unit_spec> specs{make_unit("trunk", 1024, residency::pinned), make_unit("task/0", 1024),
                               make_unit("task/1", 1024, residency::prefetch, optimizer_placement::host)};
  runtime rt(dev, options_with_budget(4 * MiB), specs);
  stream s(dev);
  const unit_id trunk{0}, t0{1}, t1{2};
  rt.plan(std::vector<step_plan>{step_plan{trunk, t0}, step_plan{trunk, t1}});
  for (const unit_id task : {t0, t1}) {
    (void)rt.acquire(trunk, s);
    (void)rt.acquire(task, s);
    rt.step(task, s);
    rt.step(trunk, s);
    rt.release(task, s);
    rt.release(trunk, s);
    (void)rt.end_step();
  }
  rt.flush();
  const runtime_stats st = rt.stats();
  ASSERT_EQ(st.steps.size(), 2U);
  EXPECT_EQ(st.total.hits, 4U);
  EXPECT_EQ(st.total.misses, 0U);
  // task/1 (host placement): params up, gradients down.
  EXPECT_EQ(st.steps[1].d2h_bytes, 4096U);
  EXPECT_EQ(st.units[0].state, unit_state::resident);
  EXPECT_EQ(st.units[2].step, 1);
  EXPECT_EQ(st.pinned_device_bytes, rt.device_bytes(trunk));
  EXPECT_LE(st.host_bytes_pinned, st.home_bytes + 4096);  // pinned ≤ slab bytes + a page
  EXPECT_LE(st.total.peak_device_bytes, st.budget);
}

TEST(runtime_trace, the_chrome_trace_has_a_track_per_stream_and_a_device_bytes_counter)
{
  device dev = emulated(4 * MiB);
  runtime_options o = options_with_budget(4 * MiB);
  o.trace = true;
  runtime rt(dev, o,
             {make_unit("task/0", 4096), make_unit("task/1", 4096, residency::prefetch, optimizer_placement::host)});
  stream s(dev);
  rt.plan(std::vector<step_plan>{step_plan{unit_id{0}}, step_plan{unit_id{1}}});
  for (std::uint32_t k = 0; k < 2; ++k) {
    (void)rt.acquire(unit_id{k}, s);
    rt.step(unit_id{k}, s);
    rt.release(unit_id{k}, s);
    (void)rt.end_step();
  }
  const std::string file = ::testing::TempDir() + "taskswap_trace.json";
  rt.write_trace(file);
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  for (const char* needle : {"\"traceEvents\"", "h2d (swap-in)", "d2h (write-back)", "host optimizer", "compute 1",
                             "\"swap-in task/0\"", "\"adamw task/1\"", "\"grads task/1\"", "\"device bytes\""}) {
    EXPECT_NE(json.find(needle), std::string::npos) << needle;
  }
  EXPECT_EQ(std::count(json.begin(), json.end(), '{'), std::count(json.begin(), json.end(), '}'));
}

// A state tensor lies after the trainable ones, travels with the parameters, comes home with the
// update (also through eviction) and is never stepped; its gradient elements are ignored.
TEST(state_tensors, travel_come_home_with_the_update_and_are_never_stepped)
{
  for (const dtype compute : {dtype::f32, dtype::bf16}) {
    for (const optimizer_placement place : {optimizer_placement::device, optimizer_placement::host}) {
      SCOPED_TRACE(std::string(to_string(compute)) + "/" + std::string(to_string(place)));
      unit_spec u;
      u.name = "bn";
      u.tensors = {{"mean", {3}, false, true}, {"w", {70}}, {"var", {3}, false, true}};
      u.compute = compute;
      u.policy = unit_policy{residency::on_demand, 0, place};
      unit_spec other = make_unit("other", 4000, residency::on_demand, place);
      const detail::unit_layout l = detail::make_unit_layout(u, place);
      EXPECT_EQ(l.tensors[1].offset, 0U);  // the trainable tensor first
      EXPECT_EQ(l.trainable, 70U);
      EXPECT_EQ(l.tensors[0].offset, 128U);
      EXPECT_EQ(l.tensors[2].offset, 192U);
      EXPECT_TRUE(l.tensors[0].state && !l.tensors[1].state);
      // Room for one of the two at a time: each step evicts the other.
      runtime_options o = options_with_budget(footprint(other, place).device_bytes + 256);
      const device dev = emulated(1 * MiB);
      runtime rt(dev, o, {u, other});
      const home_view h0 = rt.home(unit_id{0});
      for (std::size_t i = 0; i < h0.master.count; ++i) { static_cast<float*>(h0.master.data)[i] = 0.5F; }
      for (const std::size_t t : {std::size_t{0}, std::size_t{2}}) {  // state tensors: in the parameters
        for (std::size_t i = 0; i < 3; ++i) {
          detail::narrow_element(h0.params.data, compute, h0.tensors[t].offset + i, -1.0F);
        }
      }
      stream s(dev);
      for (int k = 0; k < 4; ++k) {
        const unit_use use = k == 3 ? unit_use::frozen : unit_use::train;
        rt.plan(step_plan().acquire(unit_id{0}, use));
        const unit_view v = rt.acquire(unit_id{0}, s, use);
        const tensor_view mean = v.param_tensor(0);
        const tensor_view var = v.param_tensor(2);
        launch_host_func(s, [mean, var, k, compute] {
          for (std::size_t i = 0; i < 3; ++i) {
            const float seen = detail::widen_element(mean.memory.data(), compute, i);
            // The value the last trained step wrote arrived with the unit (-1 at first).
            if (seen != (k == 0 ? -1.0F : static_cast<float>(k - 1))) {
              throw std::runtime_error("state did not travel");
            }
            if (k == 3) { continue; }  // a frozen use reads them (as torch's eval mode)
            detail::narrow_element(mean.memory.data(), compute, i, static_cast<float>(k));
            detail::narrow_element(var.memory.data(), compute, i, static_cast<float>(10 * k));
          }
        });
        if (use == unit_use::train) {
          const slab_view g = v.grads;
          launch_host_func(s, [g] {  // every element, the state tensors' too: those are ignored
            for (std::size_t i = 0; i < g.count; ++i) { detail::narrow_element(g.data, g.type, i, 0.25F); }
          });
          rt.step(unit_id{0}, s);
        }
        rt.release(unit_id{0}, s);
        (void)rt.end_step();
        rt.plan(step_plan{unit_id{1}});  // evicts "bn"
        (void)rt.acquire(unit_id{1}, s);
        rt.release(unit_id{1}, s);
        (void)rt.end_step();
      }
      rt.flush();
      EXPECT_GE(rt.stats().units[0].swap_ins, 4U);
      const home_view h = rt.home(unit_id{0});
      for (std::size_t i = 0; i < 3; ++i) {
        // The last trained step's values came home through each eviction.
        EXPECT_EQ(detail::widen_element(h.params.data, compute, h.tensors[0].offset + i), 2.0F);
        EXPECT_EQ(detail::widen_element(h.params.data, compute, h.tensors[2].offset + i), 20.0F);
      }
      const float* master = static_cast<const float*>(h.master.data);
      for (std::size_t i = 0; i < 70; ++i) { ASSERT_NE(master[i], 0.5F) << i; }  // stepped
      EXPECT_EQ(h.step, 3);
    }
  }
  unit_spec only;
  only.name = "stats";
  only.tensors = {{"mean", {3}, false, true}};
  expect_error_mentioning<config_error>([&] { (void)footprint(only, optimizer_placement::device); },
                                        "only state tensors");
}

}  // namespace
}  // namespace taskswap::test
