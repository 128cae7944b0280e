// SPDX-License-Identifier: Apache-2.0
// best_fit_ranges: the placement the pinned arena and the device pool share. The arena's tests
// drive it with random allocations against a model; these pin down its own contract.

#include "device/best_fit_ranges.hpp"

#include <gtest/gtest.h>

namespace taskswap::test {
namespace {

using detail::best_fit_ranges;

TEST(best_fit_ranges, AlignsTheRealAddressNotTheOffset)
{
  best_fit_ranges r(4096, 0x1000 + 64);  // offset 0 lives 64 bytes past a 4 KiB boundary
  const auto a = r.allocate(10, 256);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ((0x1000 + 64 + *a) % 256, 0U);
  EXPECT_EQ(*a, 192U);
  EXPECT_EQ(r.used(), 192U + 10U);  // the padding is charged to the range
}

TEST(best_fit_ranges, PicksTheSmallestBlockThatFits)
{
  best_fit_ranges r(1000, 0);
  const auto a = r.allocate(100, 1);
  const auto b = r.allocate(300, 1);
  const auto c = r.allocate(50, 1);
  const auto d = r.allocate(200, 1);
  ASSERT_TRUE(a && b && c && d);
  ASSERT_TRUE(r.deallocate(*b, 300));
  ASSERT_TRUE(r.deallocate(*d, 200));  // free now: 300 at b, 200+350 at d (coalesced with the tail)
  const auto e = r.allocate(250, 1);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(*e, *b);  // 300 is the best fit for 250, not the 550 tail
}

TEST(best_fit_ranges, RefusesWhatIsNotALiveRangeAndCoalescesTheRest)
{
  best_fit_ranges r(1024, 0);
  const auto a = r.allocate(256, 1);
  const auto b = r.allocate(256, 1);
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(r.deallocate(*a, 255));  // wrong size
  EXPECT_FALSE(r.deallocate(*a + 1, 255));  // not a range start
  EXPECT_TRUE(r.deallocate(*a, 256));
  EXPECT_FALSE(r.deallocate(*a, 256));  // twice
  EXPECT_EQ(r.free_blocks(), 2U);
  EXPECT_TRUE(r.deallocate(*b, 256));
  EXPECT_EQ(r.free_blocks(), 1U);
  EXPECT_EQ(r.largest_free(), 1024U);
  EXPECT_EQ(r.used(), 0U);
  EXPECT_FALSE(r.allocate(1025, 1).has_value());
}

}  // namespace
}  // namespace taskswap::test
