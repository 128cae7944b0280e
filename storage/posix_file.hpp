// SPDX-License-Identifier: Apache-2.0
#pragma once

// A file descriptor that closes itself: the one POSIX file type of the checkpoints and the unit
// files. Its calls return the system's answer (0, or the errno; EINTR is retried) and throw
// nothing, so each caller phrases its own error (a checkpoint_error naming the checkpoint, a
// storage_error naming the unit).

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace taskswap::detail {

class posix_file {
 public:
  /// What read_at() returns when the file ends before the bytes asked for.
  static constexpr int ended = -1;

  posix_file() = default;
  /// Opens `path` with `flags` (O_CLOEXEC added); on failure is_open() is false and error() says why.
  posix_file(std::filesystem::path path, int flags, mode_t mode = 0644) noexcept;
  ~posix_file();
  posix_file(posix_file&& other) noexcept;
  posix_file& operator=(posix_file&& other) noexcept;
  posix_file(const posix_file&) = delete;
  posix_file& operator=(const posix_file&) = delete;

  [[nodiscard]] bool is_open() const noexcept { return fd_ >= 0; }
  [[nodiscard]] int error() const noexcept { return error_; }  ///< the open's errno
  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

  /// Reads exactly data.size() bytes at `offset`: 0, `ended`, or the errno.
  [[nodiscard]] int read_at(std::span<std::byte> data, std::uint64_t offset) const noexcept;
  /// Writes all of `data` at `offset`: 0 or the errno.
  [[nodiscard]] int write_at(std::span<const std::byte> data, std::uint64_t offset) const noexcept;
  /// Writes all of `data` at the file's position: 0 or the errno.
  [[nodiscard]] int write_all(std::span<const std::byte> data) const noexcept;
  /// fsync: 0 or the errno.
  [[nodiscard]] int sync() const noexcept;
  /// fstat: 0 or the errno.
  [[nodiscard]] int status(struct stat& st) const noexcept;
  /// Makes the file's first `bytes` exist (zeros where it had none; posix_fallocate, or ftruncate
  /// where the file system has no fallocate): 0 or the errno.
  [[nodiscard]] int reserve(std::uint64_t bytes) const noexcept;
  /// ftruncate: 0 or the errno.
  [[nodiscard]] int truncate(std::uint64_t bytes) const noexcept;
  /// An exclusive flock, not waiting: 0 or the errno (EWOULDBLOCK: another holds it).
  [[nodiscard]] int lock() const noexcept;
  /// Drops the file's pages from the page cache (read once, or written and synced).
  void forget() const noexcept;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  int error_ = 0;
};

/// Flushes a directory's entries (after files were created or renamed in it): 0 or the errno.
[[nodiscard]] int sync_directory(const std::filesystem::path& dir) noexcept;

/// The errno's text, as strerror gives it.
[[nodiscard]] std::string errno_reason(int e);

}  // namespace taskswap::detail
