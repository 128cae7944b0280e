// SPDX-License-Identifier: Apache-2.0
#pragma once

// A round trip through device memory: `home` is filled with fresh random bytes, copied to a
// device buffer and back into `back` (poisoned first), and must come back bit for bit.

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>

namespace taskswap::test {

inline void expect_round_trip(const device& dev, std::span<std::byte> home, std::span<std::byte> back,
                              std::uint32_t seed)
{
  ASSERT_EQ(home.size(), back.size());
  std::mt19937 gen{seed};
  for (auto& b : home) { b = static_cast<std::byte>(gen()); }
  std::fill(back.begin(), back.end(), std::byte{0xEE});
  device_buffer slot(dev, home.size());
  stream s(dev);
  copy_async(slot.span(), home, s);
  copy_async(back, slot.span(), s);
  s.synchronize();
  EXPECT_TRUE(std::equal(home.begin(), home.end(), back.begin()));
}

}  // namespace taskswap::test
