// SPDX-License-Identifier: Apache-2.0
#pragma once

// The runtime's counters (runtime::stats): the current step's, the totals, the recent steps, each
// unit's swap-ins and write-backs, and the stall timers on the trainer's streams. Every figure
// the runtime reports is counted here, by a named event (a hit, a swap-in of so many bytes, ...),
// and nowhere else.

#include <taskswap/device.hpp>
#include <taskswap/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace taskswap::detail {

/// Steps whose stats runtime::stats() keeps.
inline constexpr std::size_t stats_history = 4096;

class step_ledger {
 public:
  /// A ledger for `units` units, counting step `first` first.
  step_ledger(const device& dev, std::size_t units, std::uint64_t first = 0);

  // Acquisitions
  void hit() noexcept { ++current_.hits; }
  void miss() noexcept { ++current_.misses; }
  void unplanned() noexcept { ++current_.unplanned; }
  void frozen_use() noexcept { ++current_.frozen; }

  // Traffic
  /// A swap-in of `unit`: `bytes` host→device.
  void swap_in(std::uint32_t unit, std::size_t bytes) noexcept
  {
    ++current_.swap_ins;
    current_.h2d_bytes += bytes;
    ++units_[unit].swap_ins;
  }
  /// A write-back of `unit`: `bytes` device→host.
  void write_back(std::uint32_t unit, std::size_t bytes) noexcept
  {
    ++current_.write_backs;
    current_.d2h_bytes += bytes;
    ++units_[unit].write_backs;
  }
  /// Parameters uploaded after a host update.
  void upload(std::size_t bytes) noexcept { current_.h2d_bytes += bytes; }
  /// Gradients (and state tensors) copied home for a host update.
  void to_home(std::size_t bytes) noexcept { current_.d2h_bytes += bytes; }
  void eviction() noexcept { ++current_.evictions; }
  /// The device pool's bytes in use now: the step's peak.
  void device_bytes(std::size_t used) noexcept
  {
    current_.peak_device_bytes = std::max(current_.peak_device_bytes, used);
  }
  /// The step's reduction (with a communicator): what it moved, and what reducing every unit would have.
  void reduced(std::size_t bytes, std::size_t all_bytes) noexcept
  {
    current_.reduced_bytes = bytes;
    current_.reduce_all_bytes = all_bytes;
  }

  // Stalls
  /// Makes `s` wait for `arrived`, timing the wait when `measure` (a timer pair around the wait).
  void wait_timed(const event& arrived, stream_view s, bool measure);
  /// Adds the finished timers' waits to their steps; with `wait`, waits for every one (up to
  /// `timeout`, then timeout_error).
  void resolve_stalls(bool wait, std::chrono::milliseconds timeout);

  // Steps
  [[nodiscard]] std::uint64_t step() const noexcept { return current_.step; }
  /// Ends the current step: its stats join the totals and the history, and the next one opens
  /// with the device bytes in use now as its peak so far.
  step_stats close(std::size_t device_used);
  /// Counting restarts at step `first` (a checkpoint's).
  void restart_at(std::uint64_t first) noexcept { current_.step = first; }

  /// The totals, the recent steps, and each unit's counts into `s.units` (one per unit, in id order).
  void report(runtime_stats& s) const;

 private:
  struct unit_counts {
    std::size_t swap_ins = 0;
    std::size_t write_backs = 0;
  };
  struct stall_timer {
    event begin;
    event end;
    std::uint64_t step = 0;
  };
  step_stats* stats_of(std::uint64_t step) noexcept;

  device device_;
  step_stats current_{};
  step_stats total_{};
  std::deque<step_stats> history_;
  std::vector<unit_counts> units_;
  std::vector<stall_timer> stalls_pending_;
  std::vector<stall_timer> stalls_free_;
};

}  // namespace taskswap::detail
