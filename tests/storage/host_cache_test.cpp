// SPDX-License-Identifier: Apache-2.0
// The host cache's choice of a victim (Note [Host cache]): Belady's rule over the plan's next
// uses, where a superseded block counts as never used again and one that needs no write goes
// first among equals; a prefetch takes only room that costs nothing.

#include "scratch_dir.hpp"
#include "storage/host_cache.hpp"

#include <taskswap/device.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
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

struct two_block_cache {
  explicit two_block_cache(const std::filesystem::path& dir)
      : memory(static_cast<std::byte*>(std::aligned_alloc(4096, 2 * block)), &std::free),
        files({.directory = dir, .queue_depth = 2, .block_bytes = block}),
        cache(dev, {memory.get(), 2 * block}, files)
  {}
  device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
  std::unique_ptr<std::byte, decltype(&std::free)> memory;
  unit_files files;
  host_cache cache;
};

// Two blocks of room: `a` dirty, `b` clean, both never used again; `a` was used first. Making
// room for `c` lets the clean one go (nothing to write), not the least recently used.
TEST_F(host_cache_test, among_blocks_used_equally_far_a_clean_one_goes_before_a_dirty_one)
{
  two_block_cache t(dir_);
  host_cache& cache = t.cache;
  const host_cache::entry_id a = cache.add("a", 1, block);
  const host_cache::entry_id b = cache.add("b", 2, block);
  const host_cache::entry_id c = cache.add("c", 3, block);
  (void)cache.block(a);
  (void)cache.block(b);
  cache.flush();  // both clean, in their files
  cache.used(a, nullptr, true);
  const host_cache_stats s = cache.stats();
  (void)cache.block(c);
  EXPECT_EQ(cache.stats().written_back, s.written_back);  // `b` let go, unwritten
  (void)cache.block(a);
  EXPECT_EQ(cache.stats().hits, s.hits + 1);  // `a` stayed
}

// A prefetch moves a read earlier but adds no read and no write: with `a` dirty and `b` used again
// later (both kept by a read on demand's rule, `b` even by Belady's at `c`'s use), it finds no
// room for `c`; once nothing reads `b` again, it lets `b` go (clean: no write) and reads `c`.
TEST_F(host_cache_test, a_prefetch_takes_only_room_that_costs_nothing)
{
  two_block_cache t(dir_);
  host_cache& cache = t.cache;
  const host_cache::entry_id a = cache.add("a", 1, block);
  const host_cache::entry_id b = cache.add("b", 2, block);
  const host_cache::entry_id c = cache.add("c", 3, block);
  std::uint64_t b_next = 5;
  cache.next_use([&](host_cache::entry_id e) -> std::uint64_t {
    return e == a ? host_cache::never : e == b ? b_next : 2;
  });
  (void)cache.block(a);
  (void)cache.block(b);
  cache.flush();  // both clean, in their files
  cache.used(a, nullptr, true);
  const host_cache_stats s = cache.stats();
  EXPECT_FALSE(cache.prefetch(c));
  EXPECT_EQ(cache.stats().evictions, s.evictions);
  EXPECT_EQ(cache.stats().written_back, s.written_back);
  b_next = host_cache::never;
  EXPECT_TRUE(cache.prefetch(c));
  cache.pump();
  EXPECT_EQ(cache.stats().evictions, s.evictions + 1);
  EXPECT_EQ(cache.stats().written_back, s.written_back);  // `b` was clean
  EXPECT_EQ(cache.stats().prefetches, s.prefetches + 1);
  (void)cache.block(a);
  EXPECT_EQ(cache.stats().hits, s.hits + 1);  // the dirty `a` stayed
}

}  // namespace
}  // namespace taskswap::detail
