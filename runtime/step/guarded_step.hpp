// SPDX-License-Identifier: Apache-2.0
#pragma once

// A guarded step's state (loss scaling, clipping: step_guard.cpp): its memory, its copies between
// the device and home, and the updates that wait for end_step. Device (taken from the budget):
// the state, the square sums' block sums, two AdamW scalars, a step count per unit. Host (pinned,
// from the arena): the state's copy, per unit the CPU's step count (host placement) and the
// device's count read back, and per unit a copy of the state for the CPU AdamW.

#include "host/adamw_formula.hpp"
#include "host/step_guard.hpp"
#include "runtime/swap/unit_table.hpp"

#include <taskswap/device.hpp>
#include <taskswap/runtime.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace taskswap::detail {

class guarded_step {
 public:
  /// Whether `options` guard the steps: loss scaling, or clipping.
  [[nodiscard]] static bool guards(const runtime_options& options) noexcept
  {
    return options.scaler.enabled || options.optimizer.clip > 0;
  }
  /// Refuses a [scaler] section out of range (config_error, naming the key and a value to use).
  static void check_scaler(const runtime_options& options);
  /// Device bytes for `units` units (step_guard_device_bytes) and host bytes (of `host` below).
  [[nodiscard]] static std::size_t device_bytes(std::size_t units) noexcept;
  [[nodiscard]] static std::size_t host_bytes(std::size_t units) noexcept;

  /// `host`: host_bytes(units) pinned bytes. The state starts at `scale`, nothing skipped.
  guarded_step(const device& dev, std::size_t units, std::span<std::byte> host, float scale);

  /// The scale (and tracker) and each unit's step count to the device on `s`.
  void upload(const unit_table& units, stream_view s);
  /// Enqueues the copies of the state and the device's step counts home on `s`, after the last
  /// guarded work; read them with read_steps() once `s` is done.
  void download(stream_view s);
  /// After a download and its stream's work: each unit's step count from where its placement
  /// keeps it (the CPU's or the device's). Changes nothing without a download since the last read.
  void read_steps(unit_table& units);
  /// Makes `s` wait for the last guarded work (the scale is current after it).
  void wait_for_last(stream_view s) const
  {
    if (wait_done_ && !done_.query()) { done_.wait(s); }
  }
  /// Records the end of the guarded work on `s`.
  void record_done(stream_view s)
  {
    done_.record(s);
    wait_done_ = true;
  }

  [[nodiscard]] step_guard* state() const noexcept { return state_; }
  [[nodiscard]] double* block_sums() const noexcept { return block_sums_; }
  [[nodiscard]] adamw_scalars* scalars() const noexcept { return scalars_; }
  [[nodiscard]] std::int64_t* device_step(std::size_t unit) const noexcept { return steps_ + unit; }
  /// The state's host copy (current after a download and its wait, or before any upload).
  [[nodiscard]] step_guard& host_state() const noexcept { return *host_state_; }
  /// Unit i's copy of the state for the CPU AdamW, and its CPU step count.
  [[nodiscard]] step_guard* unit_guard(std::size_t unit) const noexcept { return unit_guards_ + unit; }
  [[nodiscard]] std::int64_t* host_step(std::size_t unit) const noexcept { return host_steps_ + unit; }
  /// The device state's bytes (what a CPU AdamW's factors copy reads).
  [[nodiscard]] const_device_span state_bytes() const;

  /// A trained unit's update that waits for end_step.
  void defer(std::uint32_t unit) { deferred_.push_back(unit); }
  [[nodiscard]] bool any_deferred() const noexcept { return !deferred_.empty(); }
  /// The deferred units, each once, in unit order (the order the finish sums them in).
  [[nodiscard]] std::span<const std::uint32_t> deferred();
  void clear_deferred() noexcept { deferred_.clear(); }

 private:
  std::size_t units_;
  device_buffer memory_;
  event done_;  // the last guarded step's work on aux
  step_guard* state_ = nullptr;
  double* block_sums_ = nullptr;
  adamw_scalars* scalars_ = nullptr;
  std::int64_t* steps_ = nullptr;
  step_guard* host_state_ = nullptr;
  std::int64_t* host_steps_ = nullptr;
  std::int64_t* device_steps_ = nullptr;
  step_guard* unit_guards_ = nullptr;
  bool wait_done_ = false;  // done_ was recorded: a stream that reads the state waits for it
  bool downloaded_ = false;  // copies home are enqueued: read_steps after the wait
  std::vector<std::uint32_t> deferred_;
};

}  // namespace taskswap::detail
