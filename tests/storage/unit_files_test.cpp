// SPDX-License-Identifier: Apache-2.0
// The disk home tier's unit files: round trips through io_uring, names, and each fault ending in
// one error that names the file and the unit while the other files keep their bytes.

#include "storage/unit_files.hpp"

#include "device/message.hpp"

#include "expect_error.hpp"
#include "scratch_dir.hpp"
#include "test_seed.hpp"

#include <taskswap/error.hpp>

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace taskswap::detail {
namespace {

namespace fs = std::filesystem;
using test::expect_error_mentioning;

constexpr std::size_t kib = 1024;

// Page-aligned host memory, as the pinned arena's slabs are.
struct aligned_bytes {
  explicit aligned_bytes(std::size_t n)
      : bytes(n), memory(static_cast<std::byte*>(std::aligned_alloc(4096, n)), &std::free)
  {}
  std::span<std::byte> span() const { return {memory.get(), bytes}; }
  std::size_t bytes;
  std::unique_ptr<std::byte, decltype(&std::free)> memory;
};

void fill_random(std::span<std::byte> out, std::uint64_t seed)
{
  std::mt19937_64 rng(seed);
  for (std::byte& b : out) { b = static_cast<std::byte>(rng()); }
}

bool same(std::span<const std::byte> a, std::span<const std::byte> b)
{
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

class unit_files_test : public test::scratch_dir_test {
 protected:
  unit_file_options options(unsigned depth = 4, std::size_t block = 64 * kib) const
  {
    return {.directory = dir_, .queue_depth = depth, .block_bytes = block};
  }

  // Random bytes written to the start of `f` (waited for), returned to compare with.
  aligned_bytes write_random(unit_files& files, unit_files::file_index f, std::size_t bytes,
                             std::uint64_t salt = 0) const
  {
    aligned_bytes data(bytes);
    fill_random(data.span(), seed_ + salt);
    files.wait(files.write(f, 0, data.span()));
    return data;
  }

  // Whether the start of `f` reads back as `expected`.
  static bool reads_back(unit_files& files, unit_files::file_index f, const aligned_bytes& expected)
  {
    const aligned_bytes back(expected.bytes);
    files.wait(files.read(f, 0, back.span()));
    return same(back.span(), expected.span());
  }

  std::uint64_t seed_ = test::test_seed();
  ::testing::ScopedTrace trace_{__FILE__, __LINE__, "TASKSWAP_TEST_SEED=" + std::to_string(seed_)};
};

TEST(unit_file_names, name_the_unit_and_its_identity_and_nothing_else)
{
  EXPECT_EQ(unit_files::file_name("task/7/head", 0x1234), "task%2f7%2fhead.0000000000001234.unit");
  EXPECT_EQ(unit_files::file_name("trunk.layers.0", 0xfedcba9876543210), "trunk%2elayers%2e0.fedcba9876543210.unit");
  EXPECT_EQ(unit_files::file_name("a-b_C9", 1), "a-b_C9.0000000000000001.unit");
  EXPECT_NE(unit_files::file_name("task/7", 1), unit_files::file_name("task/7", 2));
  EXPECT_NE(unit_files::file_name("task/7", 1), unit_files::file_name("task%2f7", 1));
}

TEST_F(unit_files_test, transfers_in_flight_at_once_round_trip_and_the_files_outlive_the_run)
{
  const std::size_t bytes = 1000 * kib;  // not a whole number of blocks
  const std::uint64_t seed = seed_;
  std::vector<aligned_bytes> out;
  std::vector<unit_files::transfer> writes;
  {
    unit_files files(options(3));
    std::vector<unit_files::file_index> index;
    for (std::size_t u = 0; u < 5; ++u) {
      index.push_back(files.open("task/" + std::to_string(u), 42, bytes));
      EXPECT_FALSE(files.existed(index.back()));
      EXPECT_EQ(files.file_bytes(index.back()), bytes);
      out.emplace_back(bytes);
      fill_random(out.back().span(), seed + static_cast<std::uint64_t>(u));
    }
    for (std::size_t u = 0; u < 5; ++u) { writes.push_back(files.write(index[u], 0, out[u].span())); }
    for (const unit_files::transfer t : writes) { files.wait(t); }
    for (const unit_files::file_index f : index) { files.sync(f); }
    EXPECT_EQ(files.stats().bytes_written, 5 * bytes);
    EXPECT_EQ(files.stats().requests, 5 * 16);  // 1000 KiB in blocks of 64 KiB
  }
  unit_files again(options(8, 128 * kib));
  aligned_bytes back(5 * bytes);
  std::vector<unit_files::transfer> reads;
  for (std::size_t u = 0; u < 5; ++u) {
    const unit_files::file_index f = again.open("task/" + std::to_string(u), 42, bytes);
    EXPECT_TRUE(again.existed(f));
    reads.push_back(again.read(f, 0, back.span().subspan(u * bytes, bytes)));
  }
  for (const unit_files::transfer t : reads) { again.wait(t); }
  for (std::size_t u = 0; u < 5; ++u) {
    EXPECT_TRUE(same(back.span().subspan(u * bytes, bytes), out[u].span())) << "unit " << u;
  }
  EXPECT_EQ(again.stats().resent, 0U);
}

TEST_F(unit_files_test, registered_memory_goes_as_fixed_requests)
{
  aligned_bytes arena(4 * 256 * kib);
  unit_files files(options());
  files.register_buffers(arena.span());
  const unit_files::file_index f = files.open("trunk/0", 7, 512 * kib);
  fill_random(arena.span().first(512 * kib), seed_);
  files.wait(files.write(f, 0, arena.span().first(512 * kib)));
  files.wait(files.read(f, 0, arena.span().subspan(512 * kib, 512 * kib)));
  EXPECT_TRUE(same(arena.span().first(512 * kib), arena.span().subspan(512 * kib, 512 * kib)));
  // As root (CI) registration succeeds; elsewhere the memlock limit may refuse it, said once.
  if (::geteuid() == 0) { EXPECT_EQ(files.stats().fixed, files.stats().requests); }
}

TEST_F(unit_files_test, a_full_ring_queues_the_rest_in_order)
{
  // Depth 1: every block but one waits for a place, across 24 transfers started at once.
  unit_files files(options(1, 16 * kib));
  const unit_files::file_index f = files.open("task/0", 1, 24 * 80 * kib);
  aligned_bytes data(24 * 80 * kib);
  fill_random(data.span(), seed_);
  std::vector<unit_files::transfer> ts;
  for (std::size_t k = 0; k < 24; ++k) {
    ts.push_back(files.write(f, k * 80 * kib, data.span().subspan(k * 80 * kib, 80 * kib)));
  }
  while (!files.done(ts.back())) {}
  for (const unit_files::transfer t : ts) { files.wait(t); }
  aligned_bytes back(data.bytes);
  files.wait(files.read(f, 0, back.span()));
  EXPECT_TRUE(same(back.span(), data.span()));
}

TEST_F(unit_files_test, a_directory_refusing_o_direct_falls_back_to_buffered_io)
{
  unit_files files(options(), io_faults{.refuse_direct = true});
  EXPECT_FALSE(files.direct());
  EXPECT_EQ(files.alignment(), 1U);
  const unit_files::file_index f = files.open("task/0", 3, 100'001);  // buffered: any length
  std::vector<std::byte> data(100'001);
  fill_random(data, seed_);
  files.wait(files.write(f, 1, std::span(data).subspan(1)));
  std::vector<std::byte> back(100'001);
  files.wait(files.read(f, 1, std::span(back).subspan(1)));
  EXPECT_TRUE(same(std::span(back).subspan(1), std::span(data).subspan(1)));
}

TEST_F(unit_files_test, a_tmpfs_directory_works_whether_or_not_it_takes_o_direct)
{
  struct statfs s {};
  if (::statfs("/dev/shm", &s) != 0 || s.f_type != 0x01021994 /* TMPFS_MAGIC */) {
    GTEST_SKIP() << "no tmpfs at /dev/shm";
  }
  dir_ = fs::path("/dev/shm") / ("taskswap-unit-files-" + std::to_string(::getpid()));
  unit_files files(options());  // Linux 6.6 and later: direct; before: buffered, said once
  const unit_files::file_index f = files.open("task/0", 3, 128 * kib);
  const aligned_bytes data = write_random(files, f, 128 * kib);
  EXPECT_TRUE(reads_back(files, f, data));
}

TEST_F(unit_files_test, an_injected_io_error_fails_its_transfer_only_and_names_the_file_and_unit)
{
  // Requests 1-4 write unit a; request 6 is a block of unit b's write.
  unit_files files(options(2), io_faults{.fail_request = 6, .fail_errno = EIO});
  const unit_files::file_index a = files.open("task/a", 1, 256 * kib);
  const unit_files::file_index b = files.open("task/b", 1, 256 * kib);
  const aligned_bytes da = write_random(files, a, 256 * kib);
  aligned_bytes db(256 * kib);
  fill_random(db.span(), seed_ + 1);
  const unit_files::transfer tb = files.write(b, 0, db.span());
  try {
    files.wait(tb);
    ADD_FAILURE() << "no error";
  } catch (const storage_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(files.path(b).string()), std::string::npos) << what;
    EXPECT_NE(what.find("unit 'task/b'"), std::string::npos) << what;
    EXPECT_NE(what.find("offset 65536"), std::string::npos) << what;
    EXPECT_NE(what.find("errno 5"), std::string::npos) << what;
  }
  EXPECT_TRUE(reads_back(files, a, da));  // unit a's saved bytes are intact, and the ring goes on serving
}

TEST_F(unit_files_test, an_injected_full_drive_is_one_error)
{
  unit_files files(options(4), io_faults{.fail_request = 2, .fail_errno = ENOSPC});
  const unit_files::file_index f = files.open("task/full", 9, 256 * kib);
  aligned_bytes data(256 * kib);
  fill_random(data.span(), seed_);
  expect_error_mentioning<storage_error>([&] { files.wait(files.write(f, 0, data.span())); },
                                         "No space left on device");
}

// A drive that stops answering (request 6 goes to an empty pipe and never completes): the wait
// ends after [storage] timeout with one error naming the oldest request's file and unit, every
// later call says the same, and closing the files does not hang on the request.
TEST_F(unit_files_test, a_drive_that_stops_answering_is_an_error_after_the_timeout_not_a_hang)
{
  unit_file_options o = options(2);
  o.timeout = std::chrono::milliseconds(1500);  // long beside the other requests, even under the sanitizers
  std::string first;
  {
    unit_files files(o, io_faults{.stall_request = 6});
    const unit_files::file_index a = files.open("task/a", 1, 256 * kib);
    const unit_files::file_index b = files.open("task/b", 1, 256 * kib);
    (void)write_random(files, a, 256 * kib);  // requests 1-4
    aligned_bytes db(256 * kib);
    fill_random(db.span(), seed_ + 1);
    const unit_files::transfer tb = files.write(b, 0, db.span());
    const auto t0 = std::chrono::steady_clock::now();
    try {
      files.wait(tb);
      ADD_FAILURE() << "no error";
    } catch (const storage_error& e) {
      first = e.what();
    }
    EXPECT_GE(std::chrono::steady_clock::now() - t0, o.timeout);
    EXPECT_NE(first.find("answered none of"), std::string::npos) << first;
    EXPECT_NE(first.find("writing '" + files.path(b).string() + "' (unit 'task/b') at offset 65536"), std::string::npos)
      << first;
    EXPECT_NE(first.find("[storage] timeout"), std::string::npos) << first;
    expect_error_mentioning<storage_error>([&] { (void)files.read(a, 0, db.span()); }, first);
  }
  // The drive answering again, a new ring serves the files.
  unit_files again(options(2));
  const unit_files::file_index a = again.open("task/a", 1, 256 * kib);
  const aligned_bytes data = write_random(again, a, 256 * kib);
  EXPECT_TRUE(reads_back(again, a, data));
}

TEST_F(unit_files_test, a_short_transfer_is_sent_again_for_the_rest)
{
  unit_files files(options(4), io_faults{.short_request = 3, .short_bytes = 8 * kib});
  const unit_files::file_index f = files.open("task/0", 1, 256 * kib);
  const aligned_bytes data = write_random(files, f, 256 * kib);  // requests 1-4
  EXPECT_TRUE(reads_back(files, f, data));  // requests 5-8
  EXPECT_EQ(files.stats().resent, 1U);
  EXPECT_EQ(files.stats().requests, 9U);
}

TEST_F(unit_files_test, a_read_that_ends_early_is_a_short_read_error)
{
  unit_files files(options(4), io_faults{.short_request = 2, .short_bytes = 0});
  const unit_files::file_index f = files.open("task/0", 1, 128 * kib);
  aligned_bytes back(128 * kib);
  expect_error_mentioning<storage_error>([&] { files.wait(files.read(f, 0, back.span())); }, "short read");
}

TEST_F(unit_files_test, a_write_the_drive_takes_none_of_is_an_error_saying_so)
{
  unit_files files(options(4), io_faults{.short_request = 1, .short_bytes = 0});
  const unit_files::file_index f = files.open("task/0", 1, 128 * kib);
  expect_error_mentioning<storage_error>([&] { (void)write_random(files, f, 128 * kib); },
                                         "the drive took none of the bytes");
}

TEST_F(unit_files_test, a_file_truncated_under_the_run_is_a_short_read_naming_it)
{
  unit_files files(options());
  const unit_files::file_index f = files.open("task/cut", 1, 256 * kib);
  const aligned_bytes data = write_random(files, f, 256 * kib);
  fs::resize_file(files.path(f), 64 * kib);
  try {
    files.wait(files.read(f, 0, data.span()));
    ADD_FAILURE() << "no error";
  } catch (const storage_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("short read"), std::string::npos) << what;
    EXPECT_NE(what.find(files.path(f).string()), std::string::npos) << what;
  }
}

TEST_F(unit_files_test, a_file_deleted_under_the_run_is_an_error_at_its_sync)
{
  unit_files files(options());
  const unit_files::file_index kept = files.open("task/kept", 1, 64 * kib);
  const unit_files::file_index gone = files.open("task/gone", 1, 64 * kib);
  fs::remove(files.path(gone));
  files.sync(kept);
  expect_error_mentioning<storage_error>([&] { files.sync(gone); }, "was deleted while the run used it");
}

TEST_F(unit_files_test, ranges_past_the_file_and_unaligned_direct_io_are_refused_with_the_rule)
{
  unit_files files(options());
  const unit_files::file_index f = files.open("task/0", 1, 64 * kib);
  aligned_bytes data(128 * kib);
  expect_error_mentioning<invalid_argument>([&] { (void)files.read(f, 0, data.span()); }, "past its 65536 bytes");
  if (!files.direct()) { GTEST_SKIP() << dir_ << " does not take O_DIRECT"; }
  expect_error_mentioning<invalid_argument>([&] { (void)files.read(f, 512, data.span().first(4096)); },
                                            "multiples of 4096");
  expect_error_mentioning<invalid_argument>([&] { (void)files.read(f, 0, data.span().subspan(8, 4096)); },
                                            "multiples of 4096");
}

TEST_F(unit_files_test, bad_options_and_an_unusable_directory_say_what_to_change)
{
  expect_error_mentioning<invalid_argument>([&] { unit_files files(options(0)); }, "queue_depth = 0");
  expect_error_mentioning<invalid_argument>([&] { unit_files files(options(4, 1000)); }, "multiple of 4096");
  fs::create_directories(dir_);
  const fs::path file = dir_ / "a-file";
  {
    std::ofstream(file) << "x";
  }
  unit_file_options o = options();
  o.directory = file / "below";
  expect_error_mentioning<config_error>([&] { unit_files files(o); }, "cannot make the directory");
}

// Note [Open files]: every disk home keeps its file open, so a run of many disk homes meets the
// soft open-file limit (1,024 on many systems) long before the hard one.
std::size_t open_descriptors()
{
  return static_cast<std::size_t>(std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator{}));
}

TEST_F(unit_files_test, more_files_than_the_soft_open_file_limit_raise_it_to_the_hard_one)
{
  rlimit was{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &was), 0);
  const rlim_t low = open_descriptors() + 16;
  if (was.rlim_max != RLIM_INFINITY && was.rlim_max < low + 64) {
    GTEST_SKIP() << "the hard open-file limit is too low";
  }
  rlimit lowered = was;
  lowered.rlim_cur = low;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0);
  {
    unit_files files(options());
    for (int u = 0; u < 64; ++u) { (void)files.open("task/" + std::to_string(u), 1, 4 * kib); }
    rlimit now{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &now), 0);
    EXPECT_EQ(now.rlim_cur, was.rlim_max);
    const aligned_bytes data = write_random(files, 63, 4 * kib);
    EXPECT_TRUE(reads_back(files, 63, data));
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &was), 0);
}

TEST_F(unit_files_test, more_files_than_the_hard_open_file_limit_is_an_error_saying_what_to_raise)
{
  // In a child process: a hard limit lowered cannot be raised again without privileges.
  // The child's own scratch directory (named by its process) goes with it: it never reaches TearDown.
  const auto leave = [&](int code) {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
    std::_Exit(code);
  };
  const auto child = [&] {
    // Under UBSan the first dynamic type check of a stream opens /proc files; with every
    // descriptor taken that check fails, so the error's message is made once before the limit.
    (void)message("opening '", fs::path("p").string(), "' for unit '", std::string_view("u"), "': ", std::string("e"),
                  ". Each (", std::size_t{1}, ") may open ", rlim_t{2});
    const rlim_t low = open_descriptors() + 16;
    const rlimit lowered{.rlim_cur = low, .rlim_max = low};
    if (::setrlimit(RLIMIT_NOFILE, &lowered) != 0) { leave(2); }
    try {
      unit_files files(options());
      for (int u = 0; u < 64; ++u) { (void)files.open("task/" + std::to_string(u), 1, 4 * kib); }
    } catch (const storage_error& e) {
      const std::string what = e.what();
      std::fprintf(stderr, "%s\n", what.c_str());
      leave(what.find("ulimit -n") != std::string::npos && what.find("task/") != std::string::npos &&
                what.find("may open " + std::to_string(low)) != std::string::npos
              ? 0
              : 3);
    }
    leave(4);
  };
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child runs anew: no threads forked (TSan's)
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "keeps its file open");
}

}  // namespace
}  // namespace taskswap::detail
