// SPDX-License-Identifier: Apache-2.0
#include "runtime/device_pool.hpp"
#include "expect_error.hpp"
#include "test_scale.hpp"
#include "test_seed.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

const auto no_users = [](detail::device_pool::slot_id) {};

// Both ways the emulated device maps: granules counted below a page, a shared memory file at a page.
class device_pool_at : public ::testing::TestWithParam<std::size_t> {
 protected:
  [[nodiscard]] device make(std::size_t memory) const
  {
    return emulated_device({.memory_bytes = memory, .granularity = GetParam()});
  }
};

INSTANTIATE_TEST_SUITE_P(granule, device_pool_at, ::testing::Values(std::size_t{256}, std::size_t{4096}, 64 * KiB),
                         [](const auto& p) { return std::to_string(p.param) + "_bytes"; });

TEST_P(device_pool_at, TakesTheWholeGranulesOfTheBudget)
{
  const device dev = make(64 * MiB);
  const std::size_t g = GetParam();
  const std::size_t budget = 40 * MiB + g / 2;  // half a granule is never taken
  detail::device_pool pool(dev, budget);
  EXPECT_EQ(dev.memory().free, 24 * MiB);
  const auto s = pool.stats();
  EXPECT_EQ(s.budget, budget);
  EXPECT_EQ(s.capacity, 40 * MiB);
  EXPECT_EQ(s.granule, g);
  EXPECT_EQ(s.used, 0U);
  EXPECT_EQ(pool.free(), 40 * MiB);
}

// The property the runtime's plan check rests on: whatever was mapped and unmapped before, a
// request of at most the free granules is met, and nothing held moves or changes.
TEST_P(device_pool_at, AnyRequestWithinTheFreeGranulesIsMetAndHeldBytesStay)
{
  // A fresh seed each run, printed so that a failure can be replayed (TASKSWAP_TEST_SEED=<seed>).
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed << " (TASKSWAP_TEST_SEED to replay)");
  std::mt19937_64 gen{seed};
  const std::size_t g = GetParam();
  const std::size_t budget = 256 * g;
  const device dev = make(2 * budget);
  detail::device_pool pool(dev, budget);
  stream s(dev);
  struct live_slot {
    detail::device_pool::slot_id id;
    device_span range;
    std::byte fill;
  };
  std::vector<detail::device_pool::slot_id> idle;
  std::vector<std::size_t> slot_bytes;
  std::vector<live_slot> live;
  for (int i = 0; i < 48; ++i) {
    // Sizes over three orders of magnitude, most of them not whole granules.
    const double bytes = std::exp2(std::uniform_real_distribution<>(0, 10)(gen)) * static_cast<double>(g) / 8;
    slot_bytes.push_back(std::min(static_cast<std::size_t>(bytes) + 1, budget / 2));
    idle.push_back(pool.add_slot(slot_bytes.back()));
  }
  std::size_t peak_seen = 0;
  std::size_t met = 0;
  const std::size_t ops = large_case(3000, 1000);  // under a sanitizer each read-back is slow
  for (std::size_t op = 0; op < ops; ++op) {
    if (!live.empty() && gen() % 2 == 0) {
      const std::size_t i = gen() % live.size();
      std::vector<std::byte> back(live[i].range.size());
      copy_async(std::span<std::byte>(back), const_device_span(live[i].range), s);
      s.synchronize();
      ASSERT_TRUE(std::all_of(back.begin(), back.end(), [&](std::byte b) { return b == live[i].fill; }))
        << "a held range changed while others were mapped";
      pool.unmap(live[i].id);
      idle.push_back(live[i].id);
      live.erase(live.begin() + static_cast<long>(i));
      continue;
    }
    if (idle.empty()) { continue; }
    const std::size_t k = gen() % idle.size();
    const detail::device_pool::slot_id id = idle[k];
    const std::size_t bytes = 1 + gen() % slot_bytes[id];  // a frozen use maps part of a slot
    const std::size_t fits = pool.free();
    const std::optional<device_span> range =
      pool.try_map(id, bytes, [&](detail::device_pool::slot_id) { s.synchronize(); });
    if (pool.packs(slot_bytes[id])) {  // a place: met whenever a granule is free (or its class has a place)
      ASSERT_TRUE(range.has_value() || fits < g) << bytes << " bytes packed with " << fits << " free";
    } else {
      ASSERT_EQ(range.has_value(), pool.taken(bytes) <= fits) << bytes << " bytes with " << fits << " free";
    }
    if (!range) { continue; }
    ++met;
    const auto fill = static_cast<std::byte>(1 + gen() % 255);
    fill_async(*range, fill, s);
    live.push_back({id, *range, fill});
    idle.erase(idle.begin() + static_cast<long>(k));
    const auto st = pool.stats();
    ASSERT_LE(st.used, st.capacity);
    ASSERT_LE(st.requested, st.used);
    peak_seen = std::max(peak_seen, st.used);
    ASSERT_EQ(st.peak, peak_seen);
  }
  s.synchronize();
  EXPECT_GT(met, ops / 10);
  for (const live_slot& l : live) { pool.unmap(l.id); }
  EXPECT_EQ(pool.stats().used, 0U);
  EXPECT_EQ(pool.free(), budget);
}

// The case a contiguous pool fails: free room split by held ranges.
TEST_P(device_pool_at, FreeRoomSplitByHeldRangesStillHoldsALargeOne)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  detail::device_pool pool(dev, 10 * g);
  std::vector<detail::device_pool::slot_id> small;
  for (int i = 0; i < 10; ++i) {
    small.push_back(pool.add_slot(g));
    static_cast<void>(pool.map(small.back(), g, no_users));
  }
  for (std::size_t i = 0; i < small.size(); i += 2) { pool.unmap(small[i]); }  // every other one
  const auto large = pool.add_slot(5 * g);
  const device_span r = pool.map(large, 5 * g, no_users);
  stream s(dev);
  std::vector<std::byte> in(5 * g);
  std::vector<std::byte> out(5 * g);
  std::mt19937 gen{3};
  for (auto& x : in) { x = static_cast<std::byte>(gen()); }
  copy_async(r, std::span<const std::byte>(in), s);
  copy_async(std::span<std::byte>(out), const_device_span(r), s);
  s.synchronize();
  EXPECT_EQ(in, out);
  expect_error_mentioning([&] { static_cast<void>(pool.map(small[0], g, no_users)); }, "of the");
}

TEST_P(device_pool_at, ASlotMovesOnlyWhenItsGranulesWereTaken)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  detail::device_pool pool(dev, 4 * g);
  const auto a = pool.add_slot(2 * g);
  const auto b = pool.add_slot(4 * g);
  int quiesced = 0;
  const auto count = [&](detail::device_pool::slot_id) { ++quiesced; };
  const device_span first = pool.map(a, 2 * g, count);
  pool.unmap(a);
  const device_span again = pool.map(a, 2 * g - 1, count);  // its granules were still free
  EXPECT_EQ(again.data(), first.data());
  EXPECT_EQ(quiesced, 0);
  pool.unmap(a);
  static_cast<void>(pool.map(b, 4 * g, count));  // takes every granule, a's included
  pool.unmap(b);
  static_cast<void>(pool.map(b, g, count));  // b's own first granule again
  EXPECT_EQ(quiesced, 0);
  const device_span moved = pool.map(a, 2 * g, count);
  EXPECT_EQ(moved.data(), first.data());  // a slot keeps its address
  // Whether a's granules were free again depends on which b took; the pool waits only if not.
  EXPECT_LE(quiesced, 1);
  const auto st = pool.stats();
  EXPECT_EQ(st.used, 3 * g);
  EXPECT_EQ(st.requested, 3 * g);
}

// Slots of at most half a granule share granules by size class; a class granule returns when its
// last place empties, and moves only after the slots that used it are done.
TEST_P(device_pool_at, SmallSlotsShareGranulesBySizeClass)
{
  const std::size_t g = GetParam();
  if (g < 1024) { GTEST_SKIP() << "no slot of 256 bytes or more is at most half of a " << g << "-byte granule"; }
  const device dev = make(64 * g);
  detail::device_pool pool(dev, 3 * g);
  std::vector<detail::device_pool::slot_id> quarter;
  for (int i = 0; i < 5; ++i) { quarter.push_back(pool.add_slot(g / 4 - 100)); }  // 4 places a granule
  std::vector<detail::device_pool::slot_id> waited;
  const auto record = [&](detail::device_pool::slot_id s) { waited.push_back(s); };
  std::vector<device_span> places;
  for (int i = 0; i < 4; ++i) { places.push_back(pool.map(quarter[static_cast<std::size_t>(i)], g / 4 - 100, record)); }
  EXPECT_EQ(pool.stats().used, g);  // four places, one granule
  for (std::size_t i = 1; i < places.size(); ++i) { EXPECT_EQ(places[i].data(), places[0].data() + i * (g / 4)); }
  static_cast<void>(pool.map(quarter[4], 1, record));
  EXPECT_EQ(pool.stats().used, 2 * g);
  EXPECT_EQ(pool.stats().requested, 4 * (g / 4 - 100) + 1);
  for (int i = 0; i < 4; ++i) { pool.unmap(quarter[static_cast<std::size_t>(i)]); }
  EXPECT_EQ(pool.stats().used, g);  // the emptied granule went back
  const auto big = pool.add_slot(2 * g);
  static_cast<void>(pool.map(big, 2 * g, record));  // takes it, and the last free one
  EXPECT_TRUE(waited.empty());
  pool.unmap(quarter[4]);
  static_cast<void>(pool.map(quarter[4], 1, record));  // its own granule, still free: no move
  EXPECT_TRUE(waited.empty());
  pool.unmap(big);
  pool.unmap(quarter[4]);
  const auto fresh = pool.add_slot(2 * g);  // no granules of its own to take back, unlike big
  static_cast<void>(pool.map(fresh, 2 * g, record));  // best fit: the first two, both class granules' own
  EXPECT_TRUE(waited.empty());
  static_cast<void>(pool.map(quarter[0], g / 4 - 100, record));
  // Both class granules' physical granules are big's now: one moves to the free granule, after
  // the four slots that had places in it are done.
  std::sort(waited.begin(), waited.end());
  EXPECT_EQ(waited, std::vector<detail::device_pool::slot_id>(quarter.begin(), quarter.begin() + 4));
  EXPECT_EQ(pool.stats().used, 3 * g);
  expect_error_mentioning([&] { static_cast<void>(pool.shrink(quarter[0], 10)); }, "packed");
}

TEST_P(device_pool_at, ShrinkFreesTheTailAndPinnedRangesPack)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  detail::device_pool pool(dev, 8 * g);
  const device_span p1 = pool.place_pinned(300);
  const device_span p2 = pool.place_pinned(300);
  EXPECT_EQ(p2.data(), p1.data() + 512);  // packed, 256-byte aligned
  EXPECT_EQ(pool.stats().used, pool.taken(812));
  const auto a = pool.add_slot(3 * g);
  static_cast<void>(pool.map(a, 3 * g, no_users));
  const std::size_t before = pool.free();
  const device_span kept = pool.shrink(a, g + 1);
  EXPECT_EQ(kept.size(), g + 1);
  EXPECT_EQ(pool.free(), before + (3 * g - pool.taken(g + 1)));
  EXPECT_EQ(pool.stats().requested, 600 + g + 1);
  expect_error_mentioning([&] { static_cast<void>(pool.shrink(a, 3 * g)); }, "cannot keep");
}

TEST(device_pool, ErrorsSayWhatToChange)
{
  const device dev = emulated_device({.memory_bytes = 8 * MiB});
  expect_error_mentioning([&] { detail::device_pool p(dev, 0); }, "set [device] budget");
  expect_error_mentioning([&] { detail::device_pool p(dev, 9 * MiB); }, "lower [device] budget");
  const device coarse = emulated_device({.memory_bytes = 8 * MiB, .granularity = MiB});
  expect_error_mentioning([&] { detail::device_pool p(coarse, 100 * KiB); }, "smaller than one granule (1.0 MiB");
  expect_error_mentioning([] { static_cast<void>(emulated_device({.granularity = 1000})); }, "power of two");
  detail::device_pool pool(dev, 4 * MiB);
  const auto a = pool.add_slot(3 * MiB);
  const auto b = pool.add_slot(2 * MiB);
  static_cast<void>(pool.map(a, 3 * MiB, no_users));
  expect_error_mentioning([&] { static_cast<void>(pool.map(b, 2 * MiB, no_users)); },
                          "1.0 MiB (1048576 bytes) of the 4.0 MiB");
  expect_error_mentioning([&] { static_cast<void>(pool.map(a, MiB, no_users)); }, "mapped already");
  expect_error_mentioning([&] { pool.unmap(b); }, "is not mapped");
  expect_error_mentioning([&] { static_cast<void>(pool.map(b, 3 * MiB, no_users)); }, "of 2097152 bytes");
  expect_error_mentioning([&] { pool.unmap(7); }, "does not have");
  pool.unmap(a);
  EXPECT_EQ(pool.stats().used, 0U);
  EXPECT_EQ(pool.stats().peak, 3 * MiB);
}

}  // namespace
}  // namespace taskswap::test
