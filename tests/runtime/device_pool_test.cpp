// SPDX-License-Identifier: Apache-2.0
#include "device/backend.hpp"
#include "runtime/pool/device_pool.hpp"
#include "expect_error.hpp"
#include "test_scale.hpp"
#include "test_seed.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

using detail::device_pool;
const auto no_users = [](device_pool::slot_id, stream_view) { return std::string(); };

// Maps and waits for the mapping thread: the range is usable on return.
device_span map_now(device_pool& pool, device_pool::slot_id slot, std::size_t bytes,
                    const device_pool::quiesce_fn& quiesce = no_users, std::size_t keep = 0)
{
  const device_pool::mapping m = pool.map(slot, bytes, keep, quiesce);
  pool.wait(m.ready);
  return m.range;
}

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
    const std::size_t keep = gen() % 2 == 0 ? 0 : 1 + gen() % bytes;  // where a later shrink may keep
    const std::size_t fits = pool.free();
    // What moves waits for the work queued on s so far.
    const auto users = [&](device_pool::slot_id, stream_view fence) {
      event e(dev);
      e.record(s);
      e.wait(fence);
      return std::string("the test's stream");
    };
    const std::optional<device_pool::mapping> m = pool.try_map(id, bytes, keep, users);
    std::optional<device_span> range;
    if (m) {
      pool.wait(m->ready);
      range = m->range;
    }
    if (pool.packs(slot_bytes[id])) {  // a place: met whenever a granule is free (or its class has a place)
      ASSERT_TRUE(range.has_value() || fits < g) << bytes << " bytes packed with " << fits << " free";
    } else {
      ASSERT_EQ(range.has_value(), pool.taken(bytes) <= fits) << bytes << " bytes with " << fits << " free";
    }
    if (!range) { continue; }
    ++met;
    peak_seen = std::max(peak_seen, pool.stats().used);
    if (keep > 0 && keep < bytes && !pool.packs(slot_bytes[id]) && gen() % 3 == 0) {
      const std::size_t before = pool.free();
      range = pool.shrink(id, keep);  // a frozen use narrowed to its parameters
      ASSERT_EQ(pool.free(), before + pool.taken(bytes) - pool.taken(keep));
    }
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
    static_cast<void>(map_now(pool, small.back(), g));
  }
  for (std::size_t i = 0; i < small.size(); i += 2) { pool.unmap(small[i]); }  // every other one
  const auto large = pool.add_slot(5 * g);
  const device_span r = map_now(pool, large, 5 * g);
  stream s(dev);
  std::vector<std::byte> in(5 * g);
  std::vector<std::byte> out(5 * g);
  std::mt19937 gen{3};
  for (auto& x : in) { x = static_cast<std::byte>(gen()); }
  copy_async(r, std::span<const std::byte>(in), s);
  copy_async(std::span<std::byte>(out), const_device_span(r), s);
  s.synchronize();
  EXPECT_EQ(in, out);
  expect_error_mentioning([&] { static_cast<void>(pool.map(small[0], g, 0, no_users)); }, "of the");
}

TEST_P(device_pool_at, ASlotMovesOnlyWhenItsExtentsWereTaken)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  device_pool pool(dev, 4 * g);
  const auto a = pool.add_slot(2 * g);
  const auto b = pool.add_slot(4 * g);
  std::vector<device_pool::slot_id> waited;
  const auto record = [&](device_pool::slot_id slot, stream_view) {
    waited.push_back(slot);
    return std::string();
  };
  const device_span first = map_now(pool, a, 2 * g, record);
  pool.unmap(a);
  const std::size_t jobs = pool.stats().mapping_jobs;
  const device_span again = map_now(pool, a, 2 * g - 1, record);  // its extent was still free
  EXPECT_EQ(again.data(), first.data());
  EXPECT_EQ(pool.stats().mapping_jobs, jobs);  // no driver call at all
  EXPECT_TRUE(waited.empty());
  pool.unmap(a);
  // Below a page nothing is mapped for real, so nothing waits for users.
  const bool waits = dev.backend().vm_maps_memory();
  static_cast<void>(map_now(pool, b, 4 * g, record, g));  // every granule: a's extent is released, after a's users
  EXPECT_EQ(waited, (waits ? std::vector<device_pool::slot_id>{a} : std::vector<device_pool::slot_id>{}));
  pool.unmap(b);
  static_cast<void>(map_now(pool, b, g, record));  // b's first extent again: its extents part there
  EXPECT_EQ(waited.size(), waits ? 1U : 0U);
  const device_span moved = map_now(pool, a, 2 * g, record);  // from b's free tail, after b's users
  EXPECT_EQ(moved.data(), first.data());  // a slot keeps its address
  EXPECT_EQ(waited, (waits ? std::vector<device_pool::slot_id>{a, b} : std::vector<device_pool::slot_id>{}));
  const auto st = pool.stats();
  EXPECT_EQ(st.used, 3 * g);
  EXPECT_EQ(st.requested, 3 * g);
}

// Units of one shape swap through the same extents: after the first round no extent is made, and
// a slot that moves costs one job of one map and one unmap (Note [Extents]). The bytes stay.
TEST_P(device_pool_at, UnitsOfOneShapeSwapThroughTheSameExtents)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  device_pool pool(dev, 8 * g);
  stream s(dev);
  std::vector<device_pool::slot_id> slots;
  for (int i = 0; i < 6; ++i) { slots.push_back(pool.add_slot(2 * g)); }
  std::vector<device_span> live(slots.size());
  std::mt19937 gen{7};
  std::size_t reshapes = 0;
  for (std::size_t turn = 0; turn < 60; ++turn) {
    const std::size_t i = turn % slots.size();
    if (turn >= 4) {  // four at most mapped at once: the oldest goes
      const std::size_t old = (turn - 4) % slots.size();
      std::vector<std::byte> back(live[old].size());
      copy_async(std::span<std::byte>(back), const_device_span(live[old]), s);
      s.synchronize();
      ASSERT_TRUE(std::all_of(back.begin(), back.end(), [&](std::byte x) { return x == std::byte(old + 1); }));
      pool.unmap(slots[old]);
    }
    if (turn == slots.size()) { reshapes = pool.stats().reshapes; }
    const std::size_t jobs = pool.stats().mapping_jobs;
    live[i] = map_now(pool, slots[i], 2 * g - static_cast<std::size_t>(gen() % 64), no_users, g);
    EXPECT_LE(pool.stats().mapping_jobs, jobs + 1);
    fill_async(live[i], std::byte(i + 1), s);
  }
  EXPECT_EQ(pool.stats().reshapes, reshapes) << "extents were made after the first round";
  EXPECT_LE(pool.stats().extents, 8U);
}

// When a slot takes an extent, the other slots' mappings of it are unmapped in deferred jobs
// (Note [Deferred unmaps]). Slots of three sizes take turns in a budget that holds few of them, so
// maps land where a deferred unmap is still due and reshapes release handles still mapped at other
// slots; the emulated device refuses either out of order. Each range reads back what was written.
TEST_P(device_pool_at, DeferredUnmapsRunBeforeTheJobsThatNeedThem)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  device_pool pool(dev, 6 * g);
  stream s(dev);
  const std::vector<std::size_t> sizes{g, 3 * g, g, 2 * g, 3 * g, g, 2 * g};
  std::vector<device_pool::slot_id> slots;
  for (const std::size_t bytes : sizes) { slots.push_back(pool.add_slot(bytes)); }
  std::deque<std::pair<std::size_t, device_span>> live;  // oldest first: slot index, range
  // Each slot's last user (its read-back, behind a sleep) is still at work when its extents move:
  // the deferred unmaps wait for it, so the jobs after them find them due.
  std::vector<std::optional<event>> used(slots.size());
  std::deque<std::pair<std::size_t, std::vector<std::byte>>> back;  // slot index, what it held
  const auto read_and_unmap = [&] {
    const auto [i, range] = live.front();
    back.emplace_back(i, std::vector<std::byte>(range.size()));
    copy_async(std::span<std::byte>(back.back().second), const_device_span(range), s);
    used[i]->record(s);
    pool.unmap(slots[i]);
    live.pop_front();
  };
  const auto users = [&](device_pool::slot_id slot, stream_view fence) {
    const auto i = static_cast<std::size_t>(std::find(slots.begin(), slots.end(), slot) - slots.begin());
    if (!used[i] || used[i]->query()) { return std::string(); }
    used[i]->wait(fence);
    return "slot " + std::to_string(i);
  };
  std::mt19937 gen{11};
  for (std::size_t turn = 0; turn < 120; ++turn) {
    std::size_t i = gen() % slots.size();
    while (std::any_of(live.begin(), live.end(), [&](const auto& l) { return l.first == i; })) {
      i = (i + 1) % slots.size();
    }
    while (!pool.fits(slots[i], sizes[i])) { read_and_unmap(); }
    const device_span range = map_now(pool, slots[i], sizes[i], users);
    fill_async(range, std::byte(i + 1), s);
    launch_host_func(s, [] { std::this_thread::sleep_for(std::chrono::milliseconds{1}); });
    used[i].emplace(dev);
    used[i]->record(s);
    live.emplace_back(i, range);
  }
  while (!live.empty()) { read_and_unmap(); }
  s.synchronize();
  for (const auto& [i, bytes] : back) {
    EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [&, i = i](std::byte x) { return x == std::byte(i + 1); }))
      << "slot " << i;
  }
  EXPECT_GT(pool.stats().deferred_jobs, 10U);
  EXPECT_GT(pool.stats().reshapes, 10U);
}

// A slot whose extent another slot takes loses its mapping of it: a maps 2 granules and gives
// them up while `user` is blocked until `go`, b takes that extent (of the free ones of its size,
// the first made), and a maps again, at the same addresses. The unmap of a's old mapping waits for
// the fence after the user's work, on the mapping thread, and a's new mapping waits for that unmap
// (Note [Deferred unmaps]).
struct blocked_move {
  device dev;
  device_pool pool;
  stream user;
  std::atomic<bool> go{false};
  device_pool::slot_id a;
  device_pool::slot_id b;
  device_pool::mapping b_mapping;

  blocked_move(const device& d, std::size_t g, std::chrono::milliseconds timeout)
      : dev(d), pool(d, 4 * g, timeout), user(d), a(pool.add_slot(2 * g)), b(pool.add_slot(2 * g))
  {
    static_cast<void>(map_now(pool, a, 2 * g));
    pool.unmap(a);
    launch_host_func(user, [this] {
      while (!go.load()) { std::this_thread::yield(); }
    });
  }
  ~blocked_move()
  {
    go = true;
    user.synchronize();
  }
  blocked_move(const blocked_move&) = delete;
  blocked_move& operator=(const blocked_move&) = delete;
  blocked_move(blocked_move&&) = delete;
  blocked_move& operator=(blocked_move&&) = delete;

  // b takes a's extent, a's earlier users being the blocked stream's work; then a maps again.
  device_pool::mapping move_a(std::size_t bytes, std::size_t& asked)
  {
    b_mapping = pool.map(b, bytes, 0, [&](device_pool::slot_id slot, stream_view fence) {
      EXPECT_EQ(slot, a);
      ++asked;
      event e(dev);
      e.record(user);
      e.wait(fence);
      return std::string("'unit a'");
    });
    return pool.map(a, bytes, 0, no_users);
  }
};

TEST_P(device_pool_at, AMoveWaitsOnTheMappingThreadForItsUsers)
{
  const std::size_t g = GetParam();
  if (!make(g).backend().vm_maps_memory()) { GTEST_SKIP() << "below a page each range keeps its bytes: nothing moves"; }
  blocked_move t(make(64 * g), g, std::chrono::milliseconds{300'000});
  std::size_t asked = 0;
  const device_pool::mapping m = t.move_a(2 * g, asked);  // returns at once: the caller does not wait
  EXPECT_EQ(asked, 1U);
  std::this_thread::sleep_for(std::chrono::milliseconds{200});  // time enough for a job that waits for nothing
  EXPECT_TRUE(t.pool.ready(t.b_mapping.ready)) << "b's map waited for a's users";
  EXPECT_FALSE(t.pool.ready(m.ready)) << "the move did not wait for the blocked user";
  t.go = true;
  t.pool.wait(m.ready);
  stream s(t.dev);
  std::vector<std::byte> in(2 * g, std::byte{0x5a});
  std::vector<std::byte> out(2 * g);
  copy_async(m.range, std::span<const std::byte>(in), s);
  copy_async(std::span<std::byte>(out), const_device_span(m.range), s);
  s.synchronize();
  EXPECT_EQ(in, out);
}

// A fence that does not complete within the pool's timeout fails the map, naming the users, and
// every later call that asks says the same.
TEST_P(device_pool_at, AMoveWhoseUsersNeverFinishFailsWithTheirNames)
{
  const std::size_t g = GetParam();
  if (!make(g).backend().vm_maps_memory()) { GTEST_SKIP() << "below a page each range keeps its bytes: nothing moves"; }
  blocked_move t(make(64 * g), g, std::chrono::milliseconds{50});
  std::size_t asked = 0;
  const device_pool::mapping m = t.move_a(2 * g, asked);
  expect_error_mentioning<timeout_error>([&] { t.pool.wait(m.ready); }, "'unit a' used");
  expect_error_mentioning<timeout_error>([&] { t.pool.check(); }, "[runtime] timeout");
}

// The driver's calls cost the mapping thread, not the caller: with each access grant costing a
// second on the emulated device, map() returns before the job is done, and the job takes that.
TEST(device_pool, TheCallerDoesNotPayTheMappingCalls)
{
  vm_cost_model costs;
  costs.access.per_call_seconds = 1.0;
  const device dev = emulated_device({.memory_bytes = 8 * MiB, .granularity = 64 * KiB, .vm_costs = costs});
  device_pool pool(dev, 4 * MiB);
  const auto a = pool.add_slot(MiB);
  const auto start = std::chrono::steady_clock::now();
  const device_pool::mapping m = pool.map(a, MiB, 0, no_users);
  EXPECT_FALSE(pool.ready(m.ready)) << "the map's calls ran on the caller's thread";
  pool.wait(m.ready);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::seconds{1});
}

// A driver call that fails on the mapping thread (here the create of a reshape: the device's
// second allocation fails) reaches the caller at its next wait or check, with the call's error.
TEST_P(device_pool_at, AFailedMappingCallReachesTheCaller)
{
  const std::size_t g = GetParam();
  const device dev = emulated_device({.memory_bytes = 64 * g, .granularity = g}, {.fail_allocation = 2});
  device_pool pool(dev, 4 * g);  // one extent: the first allocation
  const auto a = pool.add_slot(2 * g);
  const device_pool::mapping m = pool.map(a, 2 * g, 0, no_users);  // a reshape: 4 granules into 2 + 2
  expect_error_mentioning<out_of_memory>([&] { pool.wait(m.ready); }, "injected");
  expect_error_mentioning<out_of_memory>([&] { pool.check(); }, "injected");
  const auto b = pool.add_slot(g);
  expect_error_mentioning<out_of_memory>([&] { pool.wait(pool.map(b, g, 0, no_users).ready); }, "injected");
}

// Slots of at most half a granule share granules by size class; a class granule returns when its
// last place empties, and moves only after the slots that used it are done.
TEST_P(device_pool_at, SmallSlotsShareGranulesBySizeClass)
{
  const std::size_t g = GetParam();
  if (g < 1024) { GTEST_SKIP() << "no slot of 256 bytes or more is at most half of a " << g << "-byte granule"; }
  const device dev = make(64 * g);
  device_pool pool(dev, 3 * g);
  std::vector<device_pool::slot_id> quarter;
  for (int i = 0; i < 5; ++i) { quarter.push_back(pool.add_slot(g / 4 - 100)); }  // 4 places a granule
  std::vector<device_pool::slot_id> waited;
  const auto record = [&](device_pool::slot_id slot, stream_view) {
    waited.push_back(slot);
    return std::string();
  };
  std::vector<device_span> places;
  for (std::size_t i = 0; i < 4; ++i) { places.push_back(map_now(pool, quarter[i], g / 4 - 100, record)); }
  EXPECT_EQ(pool.stats().used, g);  // four places, one granule
  for (std::size_t i = 1; i < places.size(); ++i) { EXPECT_EQ(places[i].data(), places[0].data() + i * (g / 4)); }
  static_cast<void>(map_now(pool, quarter[4], 1, record));
  EXPECT_EQ(pool.stats().used, 2 * g);
  EXPECT_EQ(pool.stats().requested, 4 * (g / 4 - 100) + 1);
  for (std::size_t i = 0; i < 4; ++i) { pool.unmap(quarter[i]); }
  EXPECT_EQ(pool.stats().used, g);  // the emptied granule went back
  EXPECT_TRUE(waited.empty());
  const auto big = pool.add_slot(2 * g);
  // It takes the emptied class granule's extent and the last free one, made one: the class
  // granule is unmapped first, after the four slots that had places in it.
  static_cast<void>(map_now(pool, big, 2 * g, record));
  std::sort(waited.begin(), waited.end());
  EXPECT_EQ(waited, std::vector<device_pool::slot_id>(quarter.begin(), quarter.begin() + 4));
  pool.unmap(quarter[4]);
  static_cast<void>(map_now(pool, quarter[4], 1, record));  // its own granule, still free: no move
  EXPECT_EQ(waited.size(), 4U);
  EXPECT_EQ(pool.stats().used, 3 * g);
  static_cast<void>(map_now(pool, quarter[0], g / 4 - 100, record));  // a place beside it
  EXPECT_EQ(pool.stats().used, 3 * g);
  expect_error_mentioning([&] { static_cast<void>(pool.shrink(quarter[0], 10)); }, "packed");
}

TEST_P(device_pool_at, ShrinkFreesTheTailAndPinnedRangesPack)
{
  const std::size_t g = GetParam();
  const device dev = make(64 * g);
  device_pool pool(dev, 12 * g);
  const device_span p1 = pool.place_pinned(300);
  const device_span p2 = pool.place_pinned(300);
  EXPECT_EQ(p2.data(), p1.data() + 512);  // packed, 256-byte aligned
  EXPECT_EQ(pool.stats().used, pool.taken(812));
  const auto a = pool.add_slot(3 * g);
  static_cast<void>(map_now(pool, a, 3 * g, no_users, g + 1));  // its extents part after g + 1 bytes
  const std::size_t before = pool.free();
  const device_span kept = pool.shrink(a, g + 1);
  EXPECT_EQ(kept.size(), g + 1);
  EXPECT_EQ(pool.free(), before + (3 * g - pool.taken(g + 1)));
  EXPECT_EQ(pool.stats().requested, 600 + g + 1);
  expect_error_mentioning([&] { static_cast<void>(pool.shrink(a, 3 * g)); }, "cannot keep");
  const auto c = pool.add_slot(3 * g);
  static_cast<void>(map_now(pool, c, 3 * g));  // one extent: it parts nowhere
  expect_error_mentioning([&] { static_cast<void>(pool.shrink(c, g)); }, "do not part there");
}

TEST(device_pool, ErrorsSayWhatToChange)
{
  const device dev = emulated_device({.memory_bytes = 8 * MiB});
  expect_error_mentioning([&] { device_pool p(dev, 0); }, "set [device] budget");
  expect_error_mentioning([&] { device_pool p(dev, 9 * MiB); }, "lower [device] budget");
  const device coarse = emulated_device({.memory_bytes = 8 * MiB, .granularity = MiB});
  expect_error_mentioning([&] { device_pool p(coarse, 100 * KiB); }, "smaller than one granule (1.0 MiB");
  expect_error_mentioning([] { static_cast<void>(emulated_device({.granularity = 1000})); }, "power of two");
  device_pool pool(dev, 4 * MiB);
  const auto a = pool.add_slot(3 * MiB);
  const auto b = pool.add_slot(2 * MiB);
  static_cast<void>(map_now(pool, a, 3 * MiB));
  expect_error_mentioning([&] { static_cast<void>(pool.map(b, 2 * MiB, 0, no_users)); },
                          "1.0 MiB (1048576 bytes) of the 4.0 MiB");
  expect_error_mentioning([&] { static_cast<void>(pool.map(a, MiB, 0, no_users)); }, "mapped already");
  expect_error_mentioning([&] { pool.unmap(b); }, "is not mapped");
  expect_error_mentioning([&] { static_cast<void>(pool.map(b, 3 * MiB, 0, no_users)); }, "of 2097152 bytes");
  expect_error_mentioning([&] { pool.unmap(7); }, "does not have");
  pool.unmap(a);
  EXPECT_EQ(pool.stats().used, 0U);
  EXPECT_EQ(pool.stats().peak, 3 * MiB);
}

}  // namespace
}  // namespace taskswap::test
