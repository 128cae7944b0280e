// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The exceptions taskswap throws. Every one derives from taskswap::error, which derives
/// from std::runtime_error, and its message says what failed and what to change.

#include <cstddef>
#include <stdexcept>
#include <string>

namespace taskswap {

/// @brief Base of every exception taskswap throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A precondition of a call does not hold (null pointer, range beyond a buffer, objects
/// of different devices). The call had no effect.
class invalid_argument : public error {
 public:
  using error::error;
};

/// @brief A configuration (file, options, plan) cannot be used; names the file, line and key or
/// the numbers that do not fit.
class config_error : public error {
 public:
  using error::error;
};

/// @brief A device or pinned allocation does not fit. Carries the numbers.
class out_of_memory : public error {
 public:
  /// @brief Builds the error.
  /// @param what the full message
  /// @param requested bytes asked for
  /// @param available bytes that were free when asked
  /// @param budget bytes the device or budget holds in all
  out_of_memory(const std::string& what, std::size_t requested, std::size_t available, std::size_t budget)
      : error(what), requested_(requested), available_(available), budget_(budget)
  {}

  /// @brief Bytes asked for.
  [[nodiscard]] std::size_t requested() const noexcept { return requested_; }
  /// @brief Bytes that were free when asked.
  [[nodiscard]] std::size_t available() const noexcept { return available_; }
  /// @brief Bytes the device or budget holds in all.
  [[nodiscard]] std::size_t budget() const noexcept { return budget_; }

 private:
  std::size_t requested_;
  std::size_t available_;
  std::size_t budget_;
};

/// @brief A CUDA runtime call failed; the message has the call, file:line, error name and text.
class cuda_error : public error {
 public:
  using error::error;
};

/// @brief A communicator call (NCCL, MPI) failed.
class comm_error : public error {
 public:
  using error::error;
};

/// @brief An operation did not finish within its timeout.
class timeout_error : public error {
 public:
  using error::error;
};

/// @brief The device failed and cannot be used any more (as after a CUDA sticky error): an
/// asynchronous operation failed; work queued after it was not done. On the emulated device, an
/// injected fault (emulated_faults).
class device_error : public error {
 public:
  using error::error;
};

/// @brief A checkpoint could not be written, or is not one this runtime can load (incomplete,
/// corrupted, or of other units); the message names the file, the unit and what differs.
class checkpoint_error : public error {
 public:
  using error::error;
};

/// @brief A unit file of the disk home tier could not be opened, read, written or synced (an I/O
/// error, a full drive, a short read, a file deleted or truncated under the run); the message
/// names the file, the unit, the offset, the bytes and the system's reason. Nothing already saved
/// (the other units' files, the last checkpoint) is changed by the failure.
class storage_error : public error {
 public:
  using error::error;
};

}  // namespace taskswap
