// SPDX-License-Identifier: Apache-2.0
#include "storage/posix_file.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace taskswap::detail {
namespace {

constexpr std::size_t io_chunk = std::size_t{8} << 20U;  // bytes per system call

}  // namespace

posix_file::posix_file(std::filesystem::path path, int flags, mode_t mode) noexcept : path_(std::move(path))
{
  do {
    fd_ = ::open(path_.c_str(), flags | O_CLOEXEC, mode);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) { error_ = errno; }
}

posix_file::~posix_file()
{
  if (fd_ >= 0) { ::close(fd_); }
}

posix_file::posix_file(posix_file&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), error_(other.error_)
{}

posix_file& posix_file::operator=(posix_file&& other) noexcept
{
  if (this != &other) {
    if (fd_ >= 0) { ::close(fd_); }
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    error_ = other.error_;
  }
  return *this;
}

int posix_file::read_at(std::span<std::byte> data, std::uint64_t offset) const noexcept
{
  while (!data.empty()) {
    const ssize_t n = ::pread(fd_, data.data(), std::min(data.size(), io_chunk), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) { continue; }
    if (n < 0) { return errno; }
    if (n == 0) { return ended; }
    data = data.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
  return 0;
}

int posix_file::write_at(std::span<const std::byte> data, std::uint64_t offset) const noexcept
{
  while (!data.empty()) {
    const ssize_t n = ::pwrite(fd_, data.data(), std::min(data.size(), io_chunk), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) { continue; }
    if (n <= 0) { return n < 0 ? errno : EIO; }
    data = data.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
  return 0;
}

int posix_file::write_all(std::span<const std::byte> data) const noexcept
{
  while (!data.empty()) {
    const ssize_t n = ::write(fd_, data.data(), std::min(data.size(), io_chunk));
    if (n < 0 && errno == EINTR) { continue; }
    if (n <= 0) { return n < 0 ? errno : EIO; }
    data = data.subspan(static_cast<std::size_t>(n));
  }
  return 0;
}

int posix_file::sync() const noexcept
{
  int r = 0;
  do {
    r = ::fsync(fd_);
  } while (r != 0 && errno == EINTR);
  return r == 0 ? 0 : errno;
}

int posix_file::status(struct stat& st) const noexcept { return ::fstat(fd_, &st) == 0 ? 0 : errno; }

int posix_file::reserve(std::uint64_t bytes) const noexcept
{
  int e = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
  if (e == EOPNOTSUPP || e == EINVAL) { e = truncate(bytes); }
  return e;
}

int posix_file::truncate(std::uint64_t bytes) const noexcept
{
  return ::ftruncate(fd_, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
}

int posix_file::lock() const noexcept { return ::flock(fd_, LOCK_EX | LOCK_NB) == 0 ? 0 : errno; }

void posix_file::forget() const noexcept { (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED); }

int sync_directory(const std::filesystem::path& dir) noexcept
{
  const posix_file d(dir, O_RDONLY | O_DIRECTORY);
  return d.is_open() ? d.sync() : d.error();
}

std::string errno_reason(int e) { return std::strerror(e); }

}  // namespace taskswap::detail
