// SPDX-License-Identifier: Apache-2.0
#include "runtime/device_pool.hpp"
#include "expect_error.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

TEST(device_pool, HoldsExactlyTheBudgetInOneAllocation)
{
  const device dev = emulated_device({.memory_bytes = 64 * MiB});
  detail::device_pool pool(dev, 40 * MiB);
  EXPECT_EQ(dev.memory().free, 24 * MiB);  // one allocation of the budget, nothing more
  EXPECT_EQ(pool.stats().budget, 40 * MiB);
  EXPECT_EQ(pool.stats().used, 0U);
}

TEST(device_pool, NeverHandsOutMoreThanTheBudgetAndTracksThePeak)
{
  std::mt19937_64 gen{std::random_device{}()};
  const device dev = emulated_device({.memory_bytes = 32 * MiB});
  detail::device_pool pool(dev, 16 * MiB);
  std::vector<device_span> live;
  std::size_t peak_seen = 0;
  for (int op = 0; op < 3000; ++op) {
    if (!live.empty() && gen() % 2 == 0) {
      const std::size_t i = gen() % live.size();
      pool.deallocate(live[i]);
      live.erase(live.begin() + static_cast<long>(i));
      continue;
    }
    try {
      live.push_back(pool.allocate(1 + gen() % (2 * MiB), std::size_t{256} << (gen() % 4)));
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(live.back().data()) % 256, 0U);  // NOLINT
    } catch (const out_of_memory& e) {
      EXPECT_EQ(e.budget(), 16 * MiB);
    }
    const auto s = pool.stats();
    ASSERT_LE(s.used, s.budget);
    peak_seen = std::max(peak_seen, s.used);
    ASSERT_EQ(s.peak, peak_seen);
  }
  for (auto range : live) { pool.deallocate(range); }
  EXPECT_EQ(pool.stats().used, 0U);
  EXPECT_EQ(pool.stats().largest_free, 16 * MiB);
}

TEST(device_pool, RangesServeCopiesOnTheDevice)
{
  const device dev = emulated_device({.memory_bytes = 8 * MiB});
  detail::device_pool pool(dev, 4 * MiB);
  stream s(dev);
  const device_span a = pool.allocate(MiB + 3);
  const device_span b = pool.allocate(MiB + 3);
  std::vector<std::byte> in(MiB + 3);
  std::vector<std::byte> out(MiB + 3, std::byte{0});
  std::mt19937 gen{3};
  for (auto& x : in) { x = static_cast<std::byte>(gen()); }
  copy_async(a, in, s);
  copy_async(b, a, s);
  copy_async(out, b, s);
  s.synchronize();
  EXPECT_EQ(in, out);
}

TEST(device_pool, ErrorsSayWhatToChange)
{
  const device dev = emulated_device({.memory_bytes = 8 * MiB});
  expect_error_mentioning([&] { detail::device_pool p(dev, 0); }, "set [device] budget");
  expect_error_mentioning([&] { detail::device_pool p(dev, 9 * MiB); }, "lower [device] budget");
  detail::device_pool pool(dev, 4 * MiB);
  const device_span a = pool.allocate(3 * MiB);
  expect_error_mentioning([&] { static_cast<void>(pool.allocate(2 * MiB)); }, "1.0 MiB (1048576 bytes) of the 4.0 MiB");
  expect_error_mentioning([&] { pool.deallocate(a.subspan(0, 10)); }, "not a live allocation");
  device_buffer elsewhere(dev, 1024);
  expect_error_mentioning([&] { pool.deallocate(elsewhere.span()); }, "not a live allocation");
  expect_error_mentioning([&] { static_cast<void>(pool.allocate(16, 100)); }, "power of two");
  pool.deallocate(a);
  EXPECT_EQ(pool.stats().used, 0U);
  EXPECT_EQ(pool.stats().peak, 3 * MiB);
}

}  // namespace
}  // namespace taskswap::test
