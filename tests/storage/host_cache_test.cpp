// SPDX-License-Identifier: Apache-2.0
// The host cache's choice of a victim (Note [Host cache]): Belady's rule over the plan's next
// uses, where a superseded block counts as never used again.

#include "scratch_dir.hpp"
#include "storage/host_cache.hpp"

#include <taskswap/device.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

namespace taskswap::detail {
namespace {

constexpr std::size_t block = 16 * 1024;

using host_cache_test = test::scratch_dir_test;

// Two blocks of room, three homes. `a` is used next (1), then `c` (2), then `b` (5); `a`'s block
// is superseded (its device copy is newer). Making room for `c` lets `a` go, unwritten, and keeps
// `b`, which the plain rule would have taken (written to its file, and read again at its use).
TEST_F(host_cache_test, a_superseded_block_goes_first_and_unwritten_whatever_its_next_use)
{
  device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
  std::unique_ptr<std::byte, decltype(&std::free)> memory(static_cast<std::byte*>(std::aligned_alloc(4096, 2 * block)),
                                                          &std::free);
  unit_files files({.directory = dir_, .queue_depth = 2, .block_bytes = block});
  host_cache cache(dev, {memory.get(), 2 * block}, files);
  const host_cache::entry_id a = cache.add("a", 1, block);
  const host_cache::entry_id b = cache.add("b", 2, block);
  const host_cache::entry_id c = cache.add("c", 3, block);
  cache.next_use([&](host_cache::entry_id e) -> std::uint64_t { return e == a ? 1 : e == b ? 5 : 2; });
  cache.superseded([&](host_cache::entry_id e) { return e == a; });
  (void)cache.block(a);
  cache.used(a, nullptr, true);
  (void)cache.block(b);
  cache.used(b, nullptr, true);
  (void)cache.block(c);
  host_cache_stats s = cache.stats();
  EXPECT_EQ(s.evictions, 1U);
  EXPECT_EQ(s.written_back, 0U);  // `a` let go unwritten
  EXPECT_TRUE(cache.behind(a));  // its file is older than the block let go, until the write-back
  (void)cache.block(b);
  EXPECT_EQ(cache.stats().hits, s.hits + 1);  // `b` stayed
}

}  // namespace
}  // namespace taskswap::detail
