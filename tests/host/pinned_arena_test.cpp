// SPDX-License-Identifier: Apache-2.0
#include "host/topology.hpp"
#include "expect_error.hpp"
#include "round_trip.hpp"
#include "test_seed.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

device emulated() { return emulated_device({.memory_bytes = MiB}); }

std::size_t page() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

TEST(pinned_arena, ReservesExactlyTheBytesAskedRoundedToAPage)
{
  const std::size_t asked = 64 * MiB + 100;
  pinned_arena arena(emulated(), {.bytes = asked, .lock_pages = true});
  const pinned_arena_stats s = arena.stats();
  EXPECT_EQ(s.reserved, (asked + page() - 1) / page() * page());
  EXPECT_TRUE(arena.locked());
  EXPECT_EQ(s.pinned, s.reserved);
  EXPECT_LE(static_cast<double>(s.pinned), 1.01 * static_cast<double>(asked));  // no power-of-two rounding
  EXPECT_EQ(s.used, 0U);
  EXPECT_EQ(s.largest_free, s.reserved);
  EXPECT_DOUBLE_EQ(s.fragmentation(), 0.0);
}

TEST(pinned_arena, PagesLiveOnTheBoundNode)
{
  pinned_arena arena(emulated(), {.bytes = 32 * MiB});
  const auto nodes = detail::topology::instance().memory_location(arena.memory().data(), arena.memory().size());
  ASSERT_EQ(nodes.size(), 1U) << "pages spread over several nodes";
  EXPECT_EQ(nodes.front(), arena.numa_node());
  if (!arena.bound()) { GTEST_LOG_(INFO) << "strict binding refused by the OS; placement came from first touch"; }
}

TEST(pinned_arena, ReportsProgressForEveryPhase)
{
  std::vector<pin_progress> seen;
  pinned_arena arena(emulated(), {.bytes = 48 * MiB,
                                  .lock_pages = true,
                                  .chunk_bytes = 8 * MiB,
                                  .on_progress = [&](const pin_progress& p) { seen.push_back(p); }});
  auto last_of = [&](std::string_view phase) {
    const pin_progress* last = nullptr;
    for (const auto& p : seen) {
      if (p.phase == phase) { last = &p; }
    }
    return last;
  };
  const auto* prefault = last_of("prefault");
  const auto* lock = last_of("lock");
  ASSERT_NE(prefault, nullptr);
  ASSERT_NE(lock, nullptr);
  EXPECT_EQ(prefault->done_bytes, prefault->total_bytes);
  EXPECT_EQ(lock->done_bytes, arena.stats().reserved);
  EXPECT_GT(lock->bytes_per_second, 0.0);
  for (const auto& p : seen) { EXPECT_LE(p.done_bytes, p.total_bytes); }
}

TEST(pinned_arena, SlabsAreAlignedDisjointAndReused)
{
  pinned_arena arena(emulated(), {.bytes = 4 * MiB});
  std::vector<std::span<std::byte>> slabs;
  for (std::size_t alignment : {256U, 512U, 4096U, 65536U}) {
    auto slab = arena.allocate(1000 + alignment, alignment);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slab.data()) % alignment, 0U);
    EXPECT_EQ(slab.size(), 1000 + alignment);
    std::fill(slab.begin(), slab.end(), std::byte{static_cast<unsigned char>(alignment)});
    slabs.push_back(slab);
  }
  for (std::size_t i = 0; i < slabs.size(); ++i) {
    for (std::size_t j = i + 1; j < slabs.size(); ++j) {
      const bool disjoint =
        slabs[i].data() + slabs[i].size() <= slabs[j].data() || slabs[j].data() + slabs[j].size() <= slabs[i].data();
      EXPECT_TRUE(disjoint) << i << " overlaps " << j;
    }
  }
  EXPECT_EQ(arena.stats().slabs, 4U);
  for (auto slab : slabs) { arena.deallocate(slab); }
  EXPECT_EQ(arena.stats().used, 0U);
  EXPECT_EQ(arena.stats().largest_free, arena.stats().reserved);  // everything coalesced
}

TEST(pinned_arena, FragmentationFollowsTheFreeBlocks)
{
  pinned_arena arena(emulated(), {.bytes = 4 * MiB});
  std::vector<std::span<std::byte>> quarters;
  for (int i = 0; i < 4; ++i) { quarters.push_back(arena.allocate(MiB)); }
  EXPECT_EQ(arena.stats().largest_free, 0U);
  arena.deallocate(quarters[0]);
  arena.deallocate(quarters[2]);
  EXPECT_DOUBLE_EQ(arena.stats().fragmentation(), 0.5);  // two 1 MiB holes
  expect_error_mentioning([&] { static_cast<void>(arena.allocate(2 * MiB)); }, "the largest 1.0 MiB");
  arena.deallocate(quarters[1]);  // joins both holes
  EXPECT_EQ(arena.stats().largest_free, 3 * MiB);
  EXPECT_DOUBLE_EQ(arena.stats().fragmentation(), 0.0);
  auto big = arena.allocate(3 * MiB);  // the coalesced space is usable
  EXPECT_EQ(big.size(), 3 * MiB);
}

TEST(pinned_arena, RandomAllocationsMatchAModel)
{
  const std::uint64_t seed = test_seed();
  std::mt19937_64 gen{seed};
  SCOPED_TRACE("seed " + std::to_string(seed) + " (TASKSWAP_TEST_SEED to replay)");
  pinned_arena arena(emulated(), {.bytes = 16 * MiB});
  std::map<std::byte*, std::size_t> live;  // the model: start -> size
  std::size_t failures = 0;
  for (int op = 0; op < 4000; ++op) {
    if (!live.empty() && (gen() % 3 == 0 || failures > 0)) {
      auto it = live.begin();
      std::advance(it, static_cast<long>(gen() % live.size()));
      arena.deallocate({it->first, it->second});
      live.erase(it);
      failures = 0;
      continue;
    }
    const std::size_t bytes = 1 + gen() % (512 * 1024);
    const std::size_t alignment = std::size_t{256} << (gen() % 5);
    try {
      auto slab = arena.allocate(bytes, alignment);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(slab.data()) % alignment, 0U);
      ASSERT_GE(slab.data(), arena.memory().data());
      ASSERT_LE(slab.data() + bytes, arena.memory().data() + arena.memory().size());
      auto next = live.lower_bound(slab.data());
      if (next != live.end()) { ASSERT_LE(slab.data() + bytes, next->first); }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, slab.data());
      }
      live.emplace(slab.data(), bytes);
    } catch (const out_of_memory& e) {
      ++failures;
      EXPECT_EQ(e.requested(), bytes);
    }
    const auto s = arena.stats();
    ASSERT_EQ(s.slabs, live.size());
    ASSERT_LE(s.used, s.reserved);
  }
  for (const auto& [start, size] : live) { arena.deallocate({start, size}); }
  EXPECT_EQ(arena.stats().used, 0U);
  EXPECT_EQ(arena.stats().largest_free, arena.stats().reserved);
}

TEST(pinned_arena, HugePagesWorkWithOrWithoutReservedPages)
{
  pinned_arena arena(emulated(), {.bytes = 5 * MiB, .huge_pages = true});
  EXPECT_EQ(arena.stats().reserved, 6 * MiB);  // rounded to 2 MiB pages
  auto slab = arena.allocate(5 * MiB);
  std::fill(slab.begin(), slab.end(), std::byte{1});
}

TEST(pinned_arena, BadInputGivesErrorsWithTheNumbers)
{
  const device dev = emulated();
  expect_error_mentioning([&] { pinned_arena a(dev, {.bytes = 0}); }, "0 bytes");
  expect_error_mentioning([&] { pinned_arena a(dev, {.bytes = MiB, .numa_node = 4095}); },
                          "NUMA node 4095 does not exist");
  expect_error_mentioning([&] { pinned_arena a(dev, {.bytes = std::size_t{1} << 50}); }, "does not fit in NUMA node");
  expect_error_mentioning([&] { pinned_arena a(dev, {.bytes = MiB, .chunk_bytes = 0}); }, "chunk_bytes");
  pinned_arena arena(dev, {.bytes = MiB});
  expect_error_mentioning([&] { static_cast<void>(arena.allocate(0)); }, "0 bytes");
  expect_error_mentioning([&] { static_cast<void>(arena.allocate(64, 100)); }, "power of two");
  expect_error_mentioning([&] { static_cast<void>(arena.allocate(2 * MiB)); }, "no free block holds 2.0 MiB");
  std::vector<std::byte> elsewhere(64);
  expect_error_mentioning([&] { arena.deallocate(elsewhere); }, "is not a live slab");
  auto slab = arena.allocate(4096);
  expect_error_mentioning([&] { arena.deallocate(slab.subspan(0, 100)); }, "is not a live slab");
  arena.deallocate(slab);
  expect_error_mentioning([&] { arena.deallocate(slab); }, "is not a live slab");  // twice
  EXPECT_EQ(arena.stats().used, 0U);
}

TEST(pinned_arena, SlabsServeAsyncCopies)
{
  const device dev = emulated_device({.memory_bytes = 8 * MiB, .link = {.bytes_per_second = 5e9}});
  pinned_arena arena(dev, {.bytes = 8 * MiB});
  auto home = arena.allocate(3 * MiB + 7);
  auto back = arena.allocate(3 * MiB + 7);
  expect_round_trip(dev, home, back, 42);
}

}  // namespace
}  // namespace taskswap::test
