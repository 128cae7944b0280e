// SPDX-License-Identifier: Apache-2.0
// posix_file, the file type of the checkpoints and the unit files: what each call returns, checked
// against the file as std::ifstream and std::filesystem see it.

#include "scratch_dir.hpp"
#include "storage/posix_file.hpp"

#include <gtest/gtest.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace taskswap::detail {
namespace {

using posix_file_test = test::scratch_dir_test;

std::vector<std::byte> pattern(std::size_t n)
{
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) { v[i] = static_cast<std::byte>((i * 131 + 7) % 251); }
  return v;
}

std::vector<std::byte> contents(const std::filesystem::path& p)
{
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) { out[i] = static_cast<std::byte>(c[i]); }
  return out;
}

TEST_F(posix_file_test, writes_and_reads_at_offsets_and_says_where_the_file_ends)
{
  std::filesystem::create_directories(dir_);
  const std::filesystem::path p = dir_ / "f";
  const std::vector<std::byte> data = pattern(10'000);
  {
    const posix_file f(p, O_RDWR | O_CREAT | O_EXCL);
    ASSERT_TRUE(f.is_open()) << f.error();
    EXPECT_EQ(f.write_at(data, 4096), 0);
    EXPECT_EQ(f.sync(), 0);
    struct stat st {};
    EXPECT_EQ(f.status(st), 0);
    EXPECT_EQ(st.st_size, 4096 + 10'000);
    std::vector<std::byte> back(10'000);
    EXPECT_EQ(f.read_at(back, 4096), 0);
    EXPECT_EQ(back, data);
    std::vector<std::byte> past(2);
    EXPECT_EQ(f.read_at(past, 4096 + 9'999), posix_file::ended);  // one byte left, two asked for
  }
  const std::vector<std::byte> seen = contents(p);
  ASSERT_EQ(seen.size(), 4096U + 10'000U);
  EXPECT_EQ(std::vector<std::byte>(seen.begin() + 4096, seen.end()), data);
  EXPECT_TRUE(std::all_of(seen.begin(), seen.begin() + 4096, [](std::byte b) { return b == std::byte{0}; }));
}

TEST_F(posix_file_test, reserve_and_truncate_set_the_size_and_keep_the_bytes_before)
{
  std::filesystem::create_directories(dir_);
  const std::filesystem::path p = dir_ / "f";
  const posix_file f(p, O_RDWR | O_CREAT);
  ASSERT_TRUE(f.is_open());
  const std::vector<std::byte> data = pattern(100);
  EXPECT_EQ(f.write_all(data), 0);
  EXPECT_EQ(f.reserve(1 << 20), 0);
  EXPECT_EQ(std::filesystem::file_size(p), std::uintmax_t{1} << 20U);
  const std::vector<std::byte> seen = contents(p);
  EXPECT_EQ(std::vector<std::byte>(seen.begin(), seen.begin() + 100), data);
  EXPECT_EQ(f.truncate(0), 0);
  EXPECT_EQ(std::filesystem::file_size(p), 0U);
}

TEST_F(posix_file_test, a_failed_open_keeps_its_errno_and_a_second_lock_is_refused)
{
  const posix_file missing(dir_ / "none" / "f", O_RDONLY);
  EXPECT_FALSE(missing.is_open());
  EXPECT_EQ(missing.error(), ENOENT);
  std::filesystem::create_directories(dir_);
  const posix_file a(dir_, O_RDONLY | O_DIRECTORY);
  const posix_file b(dir_, O_RDONLY | O_DIRECTORY);
  EXPECT_EQ(a.lock(), 0);
  EXPECT_EQ(b.lock(), EWOULDBLOCK);
  EXPECT_EQ(sync_directory(dir_), 0);
  EXPECT_EQ(sync_directory(dir_ / "none"), ENOENT);
}

TEST_F(posix_file_test, moving_hands_over_the_descriptor_once)
{
  std::filesystem::create_directories(dir_);
  posix_file a(dir_ / "f", O_RDWR | O_CREAT);
  const int fd = a.fd();
  posix_file b(std::move(a));
  EXPECT_EQ(b.fd(), fd);
  EXPECT_FALSE(a.is_open());  // NOLINT(bugprone-use-after-move): moved from on purpose
  a = std::move(b);
  EXPECT_EQ(a.fd(), fd);
  EXPECT_EQ(a.write_all(pattern(10)), 0);
}

}  // namespace
}  // namespace taskswap::detail
