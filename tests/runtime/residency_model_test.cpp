// SPDX-License-Identifier: Apache-2.0
// The residency model alone (no device): the budget's arithmetic, the registration checks, the
// plan check and Belady's rule, which the runtime and the planner both call.

#include "comm/reducer.hpp"
#include "expect_error.hpp"
#include "runtime/residency/residency_model.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace taskswap::test {
namespace {

using detail::modelled_unit;
using detail::residency_model;
using detail::step_peak;
using detail::victim_candidate;

constexpr std::size_t KiB = 1024;

modelled_unit unit(std::string name, std::size_t device, std::size_t params, bool pinned = false)
{
  return {.name = std::move(name),
          .device_bytes = device,
          .params_bytes = params,
          .reduce_bytes = device - params,
          .pinned = pinned};
}

TEST(residency_model, charges_whole_granules_and_a_granule_per_packed_unit)
{
  const std::size_t g = 64 * KiB;
  residency_model m(10 * g + 5, g, 0,
                    {unit("trunk/0", 40 * KiB, 10 * KiB, true), unit("trunk/1", 40 * KiB, 10 * KiB, true),
                     unit("small", 20 * KiB, 5 * KiB), unit("large", 100 * KiB, 30 * KiB)});
  EXPECT_EQ(m.capacity(), 10 * g);
  EXPECT_EQ(m.pinned_packed_bytes(), 80 * KiB);
  EXPECT_EQ(m.pinned_bytes(), 2 * g);  // packed, then whole granules
  EXPECT_TRUE(m.packed(2));
  EXPECT_FALSE(m.packed(3));
  EXPECT_EQ(m.use_charge(2, true), g);  // a place: a granule at most
  EXPECT_EQ(m.use_charge(2, false), g);
  EXPECT_EQ(m.use_charge(3, true), 2 * g);
  EXPECT_EQ(m.use_charge(3, false), g);
  EXPECT_EQ(m.granule_note(), " (in whole granules of 64.0 KiB (65536 bytes))");
  // The guard's share comes first, in whole granules.
  residency_model guarded(10 * g, g, 100, {unit("u", 1000, 100)});
  EXPECT_EQ(guarded.guard_bytes(), g);
  EXPECT_EQ(guarded.capacity(), 9 * g);
}

TEST(residency_model, refuses_units_that_can_never_fit_with_the_numbers)
{
  const std::size_t g = 4 * KiB;
  expect_error_mentioning<config_error>([&] { residency_model m(8 * g, g, 0, {unit("trunk", 9 * g, g, true)}); },
                                        "the pinned units need 36.0 KiB (36864 bytes)");
  expect_error_mentioning<config_error>(
    [&] {
      residency_model m(8 * g, g, 0, {unit("trunk", 4 * g, g, true), unit("head", 5 * g, g)});
    },
    "unit 'head' needs 20.0 KiB (20480 bytes) of device memory (in whole granules of 4.0 KiB (4096 bytes)) but the "
    "budget leaves 16.0 KiB (16384 bytes)");
  expect_error_mentioning<config_error>([&] { residency_model m(g, g, 1, {unit("u", 1, 1)}); }, "leaves nothing");
}

TEST(residency_model, checks_every_point_of_a_step_under_each_rule)
{
  const std::size_t g = 256;
  modelled_unit frozen_base = unit("base", 4 * g, 4 * g);
  frozen_base.never_trained = true;
  residency_model m(10 * g, g, 0,
                    {unit("a", 4 * g, 2 * g), unit("b", 4 * g, 2 * g), unit("c", 4 * g, 2 * g), frozen_base});
  const unit_id a{0}, b{1}, c{2}, base{3};
  // a and b held at once take 8 granules; after a's release c fits without a communicator.
  EXPECT_EQ(m.check_step(step_plan{}.acquire(a).acquire(b).release(a).acquire(c), 0, {}).held, 8 * g);
  expect_error_mentioning<config_error>(
    [&] {
      (void)m.check_step(step_plan{}.acquire(a).acquire(b).release(a).acquire(c), 7, {.wait_for_reduction = true});
    },
    "plan step 7: after acquiring 'c' the units held at once ('b', 'c'; released, still counted: 'a') take 3.0 KiB");
  expect_error_mentioning<config_error>(
    [&] {
      (void)m.check_step(step_plan{}.acquire(a).acquire(b).release(a).acquire(c), 7, {.trained_count_to_end = true});
    },
    "trained units released within a step count until it ends");
  // With a communicator a frozen use of a unit no rank trains gives its room back at release (a
  // streamed layer's forward): 4 granules at most here, where counting every use to the end takes
  // 12; a frozen use of a unit other ranks train is whole and counts to the end.
  const step_plan streamed = step_plan{}
                               .acquire(a, unit_use::frozen)
                               .release(a)
                               .acquire(c, unit_use::frozen)
                               .release(c)
                               .acquire(base, unit_use::frozen)
                               .release(base)
                               .acquire(b);
  EXPECT_EQ(m.check_step(streamed, 3, {.wait_for_reduction = true}).held, 4 * g);
  const std::vector<std::uint32_t> trained_elsewhere{0, 2};
  expect_error_mentioning<config_error>(
    [&] { (void)m.check_step(streamed, 3, {.wait_for_reduction = true}, trained_elsewhere); },
    "a unit released whole within a step counts until its gradient bucket's reduction is launched");
  // Frozen uses hold their parameters alone, unless told otherwise (others train the unit).
  EXPECT_EQ(m.check_step(step_plan{}.acquire(a, unit_use::frozen).acquire(b).acquire(c, unit_use::frozen), 0, {}).held,
            8 * g);
  const std::vector<std::uint32_t> whole{0, 2};
  expect_error_mentioning<config_error>(
    [&] {
      (void)m.check_step(step_plan{}.acquire(a, unit_use::frozen).acquire(b).acquire(c, unit_use::frozen), 0, {},
                         whole);
    },
    "after acquiring 'c'");
  expect_error_mentioning<config_error>([&] { (void)m.check_step(step_plan{}.release(a), 2, {}); },
                                        "releases 'a', which the step has not acquired");
  expect_error_mentioning<config_error>([&] { (void)m.check_step(step_plan{}.acquire(a).acquire(a), 2, {}); },
                                        "while it is still held");
  expect_error_mentioning<config_error>([&] { (void)m.check_step(step_plan{}.acquire(base), 2, {}); },
                                        "registered never trained");
  EXPECT_EQ(m.check_step(step_plan{}.acquire(base, unit_use::frozen), 2, {}).held, 4 * g);
  // The slabs before rounding: a unit of 2.5 and one of 1.25 granules take 4 whole granules held
  // at once, 3.75 granules of slabs; with a communicator the first, released whole, still counts.
  residency_model r(10 * g, g, 0, {unit("d", 5 * g / 2, g), unit("e", 5 * g / 4, g)});
  const step_plan de = step_plan{}.acquire(unit_id{0}).release(unit_id{0}).acquire(unit_id{1});
  const step_peak alone = r.check_step(de, 0, {});
  EXPECT_EQ(alone.held, 3 * g);
  EXPECT_EQ(alone.raw, 5 * g / 2);
  const step_peak counted = r.check_step(de, 0, {.wait_for_reduction = true});
  EXPECT_EQ(counted.held, 5 * g);
  EXPECT_EQ(counted.raw, 15 * g / 4);
  expect_error_mentioning<config_error>(
    [&] { (void)m.check_step(step_plan{}.acquire(a).release(a).acquire(a), 3, {.trained_count_to_end = true}); },
    "again after training it");
}

// The reducer's buckets: the first at most 1 MiB, then up to the cap, a unit too large alone; and,
// before the ranks agree, where a unit's bucket ends at the latest whatever units others add.
TEST(residency_model, buckets_as_the_reducer_packs_them_and_their_latest_end_before_the_agreement)
{
  using detail::bucket_reach;
  using detail::pack_buckets;
  constexpr std::size_t MiB = 1024 * KiB;
  EXPECT_EQ(pack_buckets({}, 4 * MiB), std::vector<std::size_t>{});
  const std::vector<std::size_t> bytes{MiB / 2, MiB / 2, MiB, 3 * MiB, 5 * MiB, MiB};
  EXPECT_EQ(pack_buckets(bytes, 4 * MiB), (std::vector<std::size_t>{2, 4, 5, 6}));
  EXPECT_EQ(pack_buckets(bytes, MiB / 4), (std::vector<std::size_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(bucket_reach(bytes, 4 * MiB), (std::vector<std::size_t>{3, 3, 4, 4, 5, 6}));
  EXPECT_EQ(bucket_reach(bytes, MiB / 4), (std::vector<std::size_t>{1, 2, 3, 4, 5, 6}));
  // The latest end holds for every packing of the units with others among them: drawn orders.
  std::uint64_t x = 88172645463325252ULL;
  const auto draw = [&](std::uint64_t n) {
    x ^= x << 13U;
    x ^= x >> 7U;
    x ^= x << 17U;
    return x % n;
  };
  for (int trial = 0; trial < 2000; ++trial) {
    const std::size_t cap = (1 + draw(8)) * MiB / 2;
    std::vector<std::size_t> all;  // every rank's units, in order
    std::vector<std::size_t> mine;  // the positions in `all` of this rank's
    for (std::size_t i = 0, n = 1 + draw(12); i < n; ++i) {
      all.push_back((1 + draw(12)) * MiB / 4);
      if (draw(2) == 0) { mine.push_back(i); }
    }
    std::vector<std::size_t> mine_bytes;
    for (const std::size_t i : mine) { mine_bytes.push_back(all[i]); }
    const std::vector<std::size_t> ends = pack_buckets(all, cap);
    const std::vector<std::size_t> reach = bucket_reach(mine_bytes, cap);
    for (std::size_t k = 0; k < mine.size(); ++k) {
      const std::size_t end = *std::upper_bound(ends.begin(), ends.end(), mine[k]);  // mine[k]'s bucket's end
      const auto within = static_cast<std::size_t>(std::lower_bound(mine.begin(), mine.end(), end) - mine.begin());
      ASSERT_LE(within, reach[k]) << "trial " << trial << ": unit " << k << " of this rank";
    }
  }
}

// With a communicator a whole release gives its room back when its bucket's reduction is launched:
// at the release that makes it and every bucket before it ready.
TEST(residency_model, a_released_unit_reduced_with_the_ranks_counts_until_its_bucket_is_launched)
{
  using detail::no_point;
  using detail::reduction_points;
  const std::size_t g = 256;
  // Four layers of 2 granules (1 of parameters, 1 of gradients); backward from the last.
  residency_model m(6 * g, g, 0,
                    {unit("l0", 2 * g, g), unit("l1", 2 * g, g), unit("l2", 2 * g, g), unit("l3", 2 * g, g)});
  step_plan backward;
  for (std::uint32_t i = 4; i-- > 0;) {
    backward.acquire(unit_id{i});
    if (i < 3) { backward.release(unit_id{i + 1}); }
  }
  backward.release(unit_id{0});
  // entries: +3 +2 -3 +1 -2 +0 -1 -0
  const std::vector<std::uint32_t> order{3, 2, 1, 0};
  // A bucket a layer: each room comes back at its own release; two layers at most.
  const std::vector<std::size_t> alone{1, 2, 3, 4};
  const std::vector<std::size_t> own = reduction_points(backward, order, alone);
  EXPECT_EQ(own, (std::vector<std::size_t>{no_point, no_point, 2, no_point, 4, no_point, 6, 7}));
  EXPECT_EQ(m.check_step(backward, 0, {.wait_for_reduction = true, .reduction_points = own}).held, 4 * g);
  // Two layers a bucket: l3 waits for l2's release, l1 for l0's; three layers at most.
  const std::vector<std::size_t> pairs{2, 2, 4, 4};
  const std::vector<std::size_t> paired = reduction_points(backward, order, pairs);
  EXPECT_EQ(paired, (std::vector<std::size_t>{no_point, no_point, 4, no_point, 4, no_point, 7, 7}));
  EXPECT_EQ(m.check_step(backward, 0, {.wait_for_reduction = true, .reduction_points = paired}).held, 6 * g);
  // One bucket: every room to the step's end, which the budget refuses.
  const std::vector<std::size_t> one{4, 4, 4, 4};
  expect_error_mentioning<config_error>(
    [&] {
      (void)m.check_step(backward, 5,
                         {.wait_for_reduction = true, .reduction_points = reduction_points(backward, order, one)});
    },
    "after acquiring 'l0' the units held at once ('l1', 'l0'; released, still counted: 'l3', 'l2')");
  // A unit only other ranks train is ready at the step's start; one never released, at its end.
  EXPECT_EQ(reduction_points(backward, std::vector<std::uint32_t>{3, 9}, std::vector<std::size_t>{2, 2},
                             std::vector<std::uint32_t>{9})[2],
            2U);
  EXPECT_EQ(reduction_points(step_plan{}.acquire(unit_id{3}).release(unit_id{3}).acquire(unit_id{2}), order,
                             std::vector<std::size_t>{2, 2, 4, 4})[1],
            no_point);
  // Before the agreement: this rank's trained units alone, within bucket_cap of each other.
  EXPECT_EQ(m.local_reduction_points(backward, g), own);
  // Within two layers' bytes l2's bucket may reach l1 (other ranks' units might start a bucket
  // at l3), so l2 counts until l1's release: later than the agreed pairs say.
  EXPECT_EQ(m.local_reduction_points(backward, 2 * g),
            (std::vector<std::size_t>{no_point, no_point, 4, no_point, 6, no_point, 7, 7}));
  // A guarded step keeps a trained unit to the step's end whatever its bucket.
  expect_error_mentioning<config_error>(
    [&] {
      (void)m.check_step(backward, 5,
                         {.wait_for_reduction = true, .trained_count_to_end = true, .reduction_points = own});
    },
    "after acquiring 'l0' the units held at once ('l1', 'l0'; released, still counted: 'l3', 'l2')");
}

TEST(residency_model, belady_takes_the_furthest_use_then_the_least_recently_released)
{
  std::vector<victim_candidate> c{{.unit = 7, .next_use = 10, .last_release = 3, .idle = true},
                                  {.unit = 8, .next_use = 20, .last_release = 5, .idle = true},
                                  {.unit = 9, .next_use = 20, .last_release = 4, .idle = true}};
  EXPECT_EQ(residency_model::choose_victim(c), 2U);  // the furthest uses tie: released earlier
  c[2].idle = false;  // a tie with a unit held or needed first: the idle one is taken
  EXPECT_EQ(residency_model::choose_victim(c), 1U);
  c[1].next_use = 5;  // the furthest is not idle: a prefetch waits rather than add a fetch
  EXPECT_EQ(residency_model::choose_victim(c), c.size());
  EXPECT_EQ(residency_model::choose_victim({}), 0U);
}

TEST(residency_model, beyond_the_horizon_an_idle_unit_goes_first_the_least_recently_released)
{
  // Within the horizon Belady's rule ranks; beyond it, idle before not, then release order.
  std::vector<victim_candidate> c{{.unit = 1, .next_use = 40, .last_release = 9, .idle = false, .beyond = true},
                                  {.unit = 2, .next_use = 30, .last_release = 7, .idle = true, .beyond = true},
                                  {.unit = 3, .next_use = 20, .last_release = 5, .idle = true, .beyond = true},
                                  {.unit = 4, .next_use = 8, .last_release = 1, .idle = true, .beyond = false}};
  EXPECT_EQ(residency_model::choose_victim(c), 2U);  // unit 3: idle, released before unit 2
  c[2].idle = false;
  EXPECT_EQ(residency_model::choose_victim(c), 1U);  // the only idle unit beyond the horizon
  c[1].idle = false;  // beyond the horizon none is idle: the first there is unit 1 (held), so wait
  EXPECT_EQ(residency_model::choose_victim(c), c.size());
  c[0].beyond = c[1].beyond = c[2].beyond = false;  // all within: Belady, the furthest (not idle)
  EXPECT_EQ(residency_model::choose_victim(c), c.size());
  c[0].next_use = 4;
  c[1].idle = true;
  EXPECT_EQ(residency_model::choose_victim(c), 1U);
}

TEST(residency_model, the_horizon_is_the_longest_lookahead_of_a_prefetched_unit)
{
  const std::size_t g = 64 * KiB;
  std::vector<modelled_unit> units{unit("a", 8 * KiB, 2 * KiB), unit("b", 8 * KiB, 2 * KiB),
                                   unit("c", 8 * KiB, 2 * KiB)};
  const residency_model none(8 * g, g, 0, units);  // no unit prefetched: the whole plan
  EXPECT_FALSE(none.beyond_horizon(3, 1000));
  EXPECT_TRUE(none.beyond_horizon(3, detail::no_next_step));
  units[0].lookahead = 1;
  units[2].lookahead = 3;
  const residency_model m(8 * g, g, 0, units);
  EXPECT_EQ(m.horizon(), 3U);
  EXPECT_FALSE(m.beyond_horizon(2, 5));
  EXPECT_TRUE(m.beyond_horizon(2, 6));
  EXPECT_TRUE(m.beyond_horizon(2, detail::no_next_step));
}

}  // namespace
}  // namespace taskswap::test
