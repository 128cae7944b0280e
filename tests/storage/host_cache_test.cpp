// SPDX-License-Identifier: Apache-2.0
// The host cache's choice of a victim (Note [Host cache]): Belady's rule over the plan's next
// uses, where a superseded block counts as never used again and one that needs no write goes
// first among equals; a prefetch takes only room that costs nothing.

#include "scratch_dir.hpp"
#include "storage/host_cache.hpp"

#include <taskswap/device.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

namespace taskswap::detail {
namespace {

constexpr std::size_t block = 16 * 1024;

using host_cache_test = test::scratch_dir_test;

// Two blocks of room in front of three homes, `a`, `b` and `c`.
struct three_homes {
  explicit three_homes(const std::filesystem::path& dir)
      : memory(static_cast<std::byte*>(std::aligned_alloc(4096, 2 * block)), &std::free),
        files({.directory = dir, .queue_depth = 2, .block_bytes = block}),
        cache(dev, {memory.get(), 2 * block}, files)
  {}
  // `a` and `b` cached and in their files, then `a` written again (dirty).
  void a_dirty_b_clean()
  {
    (void)cache.block(a);
    (void)cache.block(b);
    cache.flush();
    cache.used(a, nullptr, true);
  }
  device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
  std::unique_ptr<std::byte, decltype(&std::free)> memory;
  unit_files files;
  host_cache cache;
  host_cache::entry_id a = cache.add("a", 1, block);
  host_cache::entry_id b = cache.add("b", 2, block);
  host_cache::entry_id c = cache.add("c", 3, block);
};

// `a` is used next (1), then `c` (2), then `b` (5); `a`'s block is superseded (its device copy
// is newer). Making room for `c` lets `a` go, unwritten, and keeps `b`, which the plain rule would
// have taken (written to its file, and read again at its use).
TEST_F(host_cache_test, a_superseded_block_goes_first_and_unwritten_whatever_its_next_use)
{
  three_homes t(dir_);
  host_cache& cache = t.cache;
  cache.next_use([&](host_cache::entry_id e) -> std::uint64_t { return e == t.a ? 1 : e == t.b ? 5 : 2; });
  cache.superseded([&](host_cache::entry_id e) { return e == t.a; });
  (void)cache.block(t.a);
  cache.used(t.a, nullptr, true);
  (void)cache.block(t.b);
  cache.used(t.b, nullptr, true);
  (void)cache.block(t.c);
  host_cache_stats s = cache.stats();
  EXPECT_EQ(s.evictions, 1U);
  EXPECT_EQ(s.written_back, 0U);  // `a` let go unwritten
  EXPECT_TRUE(cache.behind(t.a));  // its file is older than the block let go, until the write-back
  (void)cache.block(t.b);
  EXPECT_EQ(cache.stats().hits, s.hits + 1);  // `b` stayed
}

// A behind entry's block taken for a whole overwrite stays behind until the work that writes it
// is done: a device failure before then would leave older bytes (or none) in it.
TEST_F(host_cache_test, a_behind_entry_catches_up_once_its_overwrite_is_done_not_when_queued)
{
  three_homes t(dir_);
  host_cache& cache = t.cache;
  cache.next_use([&](host_cache::entry_id e) -> std::uint64_t { return e == t.a ? 1 : e == t.b ? 5 : 2; });
  cache.superseded([&](host_cache::entry_id e) { return e == t.a; });
  for (const host_cache::entry_id e : {t.a, t.b, t.c}) {  // `c` lets `a` go unwritten
    (void)cache.block(e);
    cache.used(e, nullptr, true);
  }
  ASSERT_TRUE(cache.behind(t.a));
  cache.superseded([](host_cache::entry_id) { return false; });
  const stream s(t.dev);
  std::atomic<bool> open{false};
  (void)cache.block(t.a, true);
  launch_host_func(s, [&open] {
    while (!open.load()) { std::this_thread::yield(); }
  });
  const stream_view view = s;
  cache.used(t.a, &view, true);
  EXPECT_TRUE(cache.behind(t.a)) << "caught up while its write was still queued";
  open = true;
  s.synchronize();
  EXPECT_FALSE(cache.behind(t.a));  // its events say the overwrite is done
}

// The device fails while writing `a`'s block (a copy home that never ran) and after reading `b`'s
// (dirty from the host). Making room waits for that work, as it ended, and raises nothing: `b` is
// written to its file as any dirty block; `a`'s block, holding what the failure left, is let go
// unwritten, its file keeps its older bytes and the entry is behind.
TEST_F(host_cache_test, after_a_device_failure_a_block_it_was_writing_is_let_go_unwritten_and_one_it_read_is_kept)
{
  const device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}}, {.fail_copy = 2});
  std::unique_ptr<std::byte, decltype(&std::free)> memory(static_cast<std::byte*>(std::aligned_alloc(4096, 2 * block)),
                                                          &std::free);
  unit_files files({.directory = dir_, .queue_depth = 2, .block_bytes = block});
  host_cache cache(dev, {memory.get(), 2 * block}, files);
  const host_cache::entry_id a = cache.add("a", 1, block);
  const host_cache::entry_id b = cache.add("b", 2, block);
  const host_cache::entry_id c = cache.add("c", 3, block);
  const host_cache::entry_id d = cache.add("d", 4, block);
  cache.next_use([&](host_cache::entry_id e) -> std::uint64_t { return e == c || e == d ? 1 : 9; });
  const auto fill = [&](host_cache::entry_id e, std::byte value) {
    const std::span<std::byte> bytes = cache.block(e);
    std::fill(bytes.begin(), bytes.end(), value);
    cache.used(e, nullptr, true);
  };
  fill(a, std::byte{1});
  fill(b, std::byte{2});
  cache.flush();  // both files hold their bytes
  fill(b, std::byte{3});  // dirty again, from the host
  device_buffer on_device(dev, block);
  const stream s(dev);
  const stream_view view = s;
  std::atomic<bool> open{false};
  launch_host_func(s, [&open] {
    while (!open.load()) { std::this_thread::yield(); }
  });
  copy_async(on_device.span(), cache.block(b), s);  // copy 1: the device reads `b`
  cache.used(b, &view, false);
  copy_async(cache.block(a), on_device.span(), s);  // copy 2 fails: `a`'s block is never written
  cache.used(a, &view, true);
  open = true;
  const std::uint64_t written = cache.stats().written_back;
  EXPECT_NO_THROW({
    (void)cache.block(c);  // room for `c` and `d`: both let go, once the stream's work ended
    (void)cache.block(d);
  });
  EXPECT_EQ(cache.stats().written_back, written + 1);  // `b`'s bytes, not `a`'s
  EXPECT_TRUE(cache.behind(a));
  EXPECT_FALSE(cache.behind(b));
  EXPECT_THROW(dev.synchronize(), device_error);  // the failure is the device's to tell
  for (const std::pair<host_cache::entry_id, std::byte>& home :
       {std::pair{b, std::byte{3}}, std::pair{a, std::byte{1}}}) {
    const std::span<std::byte> bytes = cache.block(home.first);  // read back from its file
    const std::byte value = home.second;
    EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [value](std::byte x) { return x == value; }));
  }
}

// `a` dirty, `b` clean, both never used again; `a` was used first. Making room for `c` lets the
// clean one go (nothing to write), not the least recently used.
TEST_F(host_cache_test, among_blocks_used_equally_far_a_clean_one_goes_before_a_dirty_one)
{
  three_homes t(dir_);
  t.a_dirty_b_clean();
  const host_cache_stats s = t.cache.stats();
  (void)t.cache.block(t.c);
  EXPECT_EQ(t.cache.stats().written_back, s.written_back);  // `b` let go, unwritten
  (void)t.cache.block(t.a);
  EXPECT_EQ(t.cache.stats().hits, s.hits + 1);  // `a` stayed
}

// A prefetch moves a read earlier but adds no read and no write: with `a` dirty and `b` used again
// later (both kept by a read on demand's rule, `b` even by Belady's at `c`'s use), it finds no
// room for `c`; once nothing reads `b` again, it lets `b` go (clean: no write) and reads `c`.
TEST_F(host_cache_test, a_prefetch_takes_only_room_that_costs_nothing)
{
  three_homes t(dir_);
  host_cache& cache = t.cache;
  std::uint64_t b_next = 5;
  cache.next_use([&](host_cache::entry_id e) -> std::uint64_t {
    return e == t.a ? host_cache::never : e == t.b ? b_next : 2;
  });
  t.a_dirty_b_clean();
  const host_cache_stats s = cache.stats();
  EXPECT_FALSE(cache.prefetch(t.c));
  EXPECT_EQ(cache.stats().evictions, s.evictions);
  EXPECT_EQ(cache.stats().written_back, s.written_back);
  b_next = host_cache::never;
  EXPECT_TRUE(cache.prefetch(t.c));
  cache.pump();
  EXPECT_EQ(cache.stats().evictions, s.evictions + 1);
  EXPECT_EQ(cache.stats().written_back, s.written_back);  // `b` was clean
  EXPECT_EQ(cache.stats().prefetches, s.prefetches + 1);
  (void)cache.block(t.a);
  EXPECT_EQ(cache.stats().hits, s.hits + 1);  // the dirty `a` stayed
}

}  // namespace
}  // namespace taskswap::detail
