// SPDX-License-Identifier: Apache-2.0
#pragma once

// The planner behind `taskswap plan` and the prediction column of `taskswap headroom`: from the
// units, their policies, the budget and a schedule of steps it predicts device and host bytes, the
// host cache and the drive's traffic for disk homes, the traffic per step (a replay of the runtime's rules: Belady eviction over the swapped units,
// write-back of dirty units, host-placed units' gradients home and parameters back, frozen uses
// bringing the parameters alone and narrowing a whole unit held frozen when room is needed), the transfer
// time, and the largest batch that fits beside the budget. No device is needed.

#include <taskswap/taskswap.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace taskswap::tools {

struct plan_input {
  runtime_options options;
  std::vector<unit_spec> units;
  std::vector<std::vector<std::size_t>> steps;  ///< the units (indexes) each step acquires, held to its end
  /// The units each step uses frozen (forward only: the parameters alone, nothing written back),
  /// acquired before steps[s]'s and held to its end; empty, or one list per step.
  std::vector<std::vector<std::size_t>> frozen;
  /// Where a trainer releases units within a step (a streamed trunk, its layers acquired for the
  /// forward and again for the backward): each step's calls in order, one plan per step. Then the
  /// plan check and the replay follow them, use by use; `steps` and `frozen` are not read.
  std::vector<step_plan> ordered;
  std::size_t warmup_steps = 0;  ///< leading steps replayed but not counted in the traffic
  std::size_t plan_window = 0;  ///< the trainer plans this many steps at a time (0: all at once)
  std::size_t plan_margin = 0;  ///< … the next window when this many planned steps remain
  std::size_t device_memory = 0;  ///< the device bytes the budget and activations share (0: unknown)
  std::size_t granule = 256;  ///< the device pool maps whole granules of this many bytes
  double link_bytes_per_second = 0;  ///< 0: unknown
  std::string link_source;  ///< where the rate came from
  std::size_t fixed_bytes = 0;  ///< trainer's device bytes beside the budget, whatever the batch
  std::size_t bytes_per_sample = 0;  ///< and per sample of the batch
  double disk_read_bytes_per_second = 0;  ///< the drive of [storage] path (0: unknown)
  double disk_write_bytes_per_second = 0;
  std::string disk_source;  ///< where the rates came from
};

struct plan_report {
  std::size_t units = 0;
  std::size_t pinned_units = 0;
  std::size_t budget = 0;
  std::size_t pinned_device_bytes = 0;
  std::size_t peak_device_bytes = 0;  ///< pinned + the most held at once: the least budget the plan runs in
  std::size_t granule = 0;  ///< the device pool's mapping granule
  std::size_t rounding_bytes = 0;  ///< of peak_device_bytes, what whole granules add to the slabs
  std::size_t all_resident_bytes = 0;  ///< every unit resident with its AdamW on the device
  std::size_t pinned_host_bytes = 0;  ///< the home arena (page-rounded): host homes and the host cache
  std::size_t disk_units = 0;  ///< units whose homes are on disk ([[units]] home = "disk")
  std::size_t disk_bytes = 0;  ///< their unit files
  std::size_t host_cache_bytes = 0;  ///< [storage] host_cache
  /// The most disk-home bytes one step keeps in use at once (its units with host AdamW, from
  /// acquire to update, and the largest other home it reads): a smaller cache reads some twice.
  std::size_t host_cache_step_bytes = 0;
  double disk_read_bytes_per_step = 0;  ///< unit files read into the host cache
  double disk_write_bytes_per_step = 0;  ///< dirty blocks written to them
  double disk_read_bytes_per_second = 0;
  double disk_write_bytes_per_second = 0;
  std::string disk_source;
  double disk_ms_per_step = 0;  ///< reads and writes at the drive's rates, one after the other (0 when unknown)
  std::size_t steps = 0;
  double h2d_bytes_per_step = 0;
  double d2h_bytes_per_step = 0;
  double swap_ins_per_step = 0;
  double link_bytes_per_second = 0;
  std::string link_source;
  double transfer_ms_per_step = 0;  ///< the busier direction at the link rate (0 when unknown)
  std::size_t device_memory = 0;
  std::size_t bytes_per_sample = 0;
  std::size_t fixed_bytes = 0;
  std::optional<std::int64_t> max_batch;  ///< beside the budget
  std::optional<std::int64_t> max_batch_all_resident;  ///< beside every unit resident
  /// With the trunk's activations offloaded ([activations] offload): the batch whose blocks and
  /// workspace fill the device, the budget what the workspace leaves (`taskswap plan` sets it).
  std::optional<std::int64_t> max_batch_offloaded;
};

/// Predicts. Checks what the runtime would refuse, with the same words.
/// @throws config_error for a rule that matches no unit, a unit or step that cannot fit the budget
[[nodiscard]] plan_report make_plan(const plan_input& in);

/// How many of the input's units have their homes on disk (by the configuration's rules).
[[nodiscard]] std::size_t disk_homed_units(const plan_input& in);

/// The largest batch beside `reserved` device bytes, or 0 when none fits.
[[nodiscard]] std::int64_t largest_batch(std::size_t device_memory, std::size_t reserved, std::size_t fixed,
                                         std::size_t per_sample);

/// "4.0 MiB", "1.2 GiB".
[[nodiscard]] std::string bytes_text(double bytes);
/// "25 GB/s" → bytes per second.
/// @throws config_error for text that is not a rate
[[nodiscard]] double parse_rate(std::string_view text);

}  // namespace taskswap::tools
