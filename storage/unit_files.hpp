// SPDX-License-Identifier: Apache-2.0
#pragma once

// The disk home tier's files: one file per unit, read and written through io_uring.
//
// Note [Unit files]:
// - Names. A unit's file is `<name>.<identity>.unit` in the storage directory: the unit's name
//   with every byte outside [A-Za-z0-9_-] written as %XX (so "/" and "." never reach the file
//   system), then the caller's 64-bit identity of what the unit holds (its tensors' names, shapes,
//   dtypes) in 16 hex digits. A file outlives the run that wrote it and is found again by the
//   next one; a file of another model is never read as this one. (DeepSpeed's swap files are named
//   by Python id(), so a checkpoint pointing at them could not be reloaded.)
// - Direct I/O. Files open with O_DIRECT: reads and writes go between the drive and the caller's
//   (pinned) buffers, not through the page cache, so offsets, lengths and buffer addresses are
//   multiples of alignment(). A file system that refuses O_DIRECT (tmpfs before Linux 6.6) gets
//   buffered I/O, said once per directory.
// - Space is reserved when a file is opened (fallocate), so a full drive is an error at set-up
//   that names the bytes, not a failed write in the middle of a step.
// - Requests. A transfer is split into blocks of block_bytes; at most queue_depth blocks are in
//   flight, the rest wait in order and go as completions free their places. A block that comes
//   back short is sent again for the rest (buffered I/O may do that); one that reads nothing
//   before its end is a short read: the file ends early. Buffers inside the memory given to
//   register_buffers() go as READ_FIXED / WRITE_FIXED, which spares the kernel mapping them each time.
// - Errors. The first failed block of a transfer fails the transfer; wait() throws storage_error
//   naming the file, the unit, the offset, the bytes and the errno text. Other transfers, and the
//   bytes already in other files, are not touched. The ring itself failing (a submit the kernel
//   refuses), or a wait in which the drive answers no request for `timeout`, fails every transfer
//   in flight and every later transfer and wait, with an error naming the oldest request's file
//   and unit; the requests in flight are asked to cancel, and the destructor does not wait again.
// - One thread owns a unit_files: its calls are not synchronised with each other.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace taskswap::detail {

struct unit_file_options {
  std::filesystem::path directory;  // created if missing
  unsigned queue_depth = 8;  // blocks in flight at once
  std::size_t block_bytes = std::size_t{1} << 20;  // a multiple of the direct-I/O alignment
  std::chrono::milliseconds timeout{300'000};  // a wait with no request answered this long fails the files
};

/// Faults injected into block requests, counted from 1 in the order they are sent (resends count).
struct io_faults {
  std::uint64_t fail_request = 0;  // this block completes with -fail_errno
  int fail_errno = 5;  // EIO
  std::uint64_t short_request = 0;  // this block reports short_bytes done
  std::size_t short_bytes = 0;  // 0: as at the end of the file (a short read)
  std::uint64_t stall_request = 0;  // this block is sent to an empty pipe instead: it never completes
  bool refuse_direct = false;  // the directory refuses O_DIRECT, as tmpfs did before Linux 6.6
};

struct unit_file_stats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t requests = 0;  // block requests sent, resends included
  std::uint64_t resent = 0;  // blocks sent again for the rest of a short transfer
  std::uint64_t fixed = 0;  // requests on registered buffers
};

class unit_files {
 public:
  using file_index = std::uint32_t;
  struct transfer {
    std::uint64_t id = 0;
  };

  /// @throws config_error when the directory cannot be made or used, invalid_argument for a bad
  /// queue depth or block size, storage_error when the ring cannot be set up
  explicit unit_files(unit_file_options options, io_faults faults = {});
  /// Waits for the blocks in flight (their errors are dropped), then closes the files.
  ~unit_files();
  unit_files(const unit_files&) = delete;
  unit_files& operator=(const unit_files&) = delete;

  /// The file name of a unit (Note [Unit files]).
  [[nodiscard]] static std::string file_name(std::string_view unit, std::uint64_t identity);

  /// Opens the unit's file, making it if missing, and reserves `bytes` rounded up to alignment().
  /// Returns its index. Existing contents are kept. The file stays open for the run; where the
  /// process's open-file limit is reached, its soft limit is raised to the hard one (Note [Open files]).
  /// @throws storage_error when the file cannot be made, the drive lacks the space, or the hard
  /// open-file limit is reached (the message says what to raise)
  file_index open(std::string_view unit, std::uint64_t identity, std::size_t bytes);
  /// Whether the file existed before open() (a later run finding its units' files).
  [[nodiscard]] bool existed(file_index f) const;
  [[nodiscard]] const std::filesystem::path& path(file_index f) const;
  [[nodiscard]] std::size_t file_bytes(file_index f) const;

  /// Registers `memory` (page-aligned host memory that outlives this object, e.g. the pinned
  /// arena) with the ring. Once only; a kernel that refuses it (memlock limits) leaves plain
  /// requests, said once.
  void register_buffers(std::span<std::byte> memory);

  /// Starts reading file bytes [offset, offset + into.size()) into `into`. Does not wait.
  /// @throws invalid_argument for a range past the file or not aligned for direct I/O
  [[nodiscard]] transfer read(file_index f, std::size_t offset, std::span<std::byte> into);
  /// Starts writing `from` into file bytes [offset, offset + from.size()). Does not wait; `from`
  /// must stay unchanged until the transfer is done.
  [[nodiscard]] transfer write(file_index f, std::size_t offset, std::span<const std::byte> from);
  /// Whether the transfer is over (done or failed), reaping completions without blocking.
  [[nodiscard]] bool done(transfer t);
  /// Blocks until the transfer is over; forgets it.
  /// @throws storage_error when it failed
  void wait(transfer t);
  /// Makes the file all zeros (its space dropped and reserved again, as a new file's). No transfer
  /// of the file may be in flight.
  /// @throws storage_error when the space cannot be reserved again
  void zero(file_index f);
  /// Makes the file's written bytes durable (fsync).
  /// @throws storage_error when the sync fails or the file was deleted under the run
  void sync(file_index f);
  /// @throws storage_error naming the file and its unit when the file was deleted under the run
  /// (its open descriptor still reads and writes a file no path reaches)
  void check_present(file_index f) const;

  /// Whether the directory takes O_DIRECT (false: buffered I/O, e.g. on tmpfs).
  [[nodiscard]] bool direct() const noexcept;
  /// The alignment of offsets, lengths and buffers (direct I/O; 1 when buffered).
  [[nodiscard]] std::size_t alignment() const noexcept;
  [[nodiscard]] const unit_file_options& options() const noexcept;
  [[nodiscard]] unit_file_stats stats() const noexcept;

 private:
  // Note [Open files]: each unit file stays open for the run (its transfers name the
  // descriptor), so 10,000 disk homes are 10,000 descriptors, where many systems' soft limit is
  // 1,024 (kept low for select(); the hard limit is far higher). When an open finds the limit
  // reached, the soft limit is raised to the hard one, once, and said; past the hard limit the
  // error says what to raise.
  bool raise_open_file_limit();
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace taskswap::detail
