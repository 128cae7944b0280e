// SPDX-License-Identifier: Apache-2.0
#pragma once

// The subcommands of the `taskswap` command line and what they share: the device memory and
// link rate a configuration implies, and the planner's input for the sample model.

#include "model.hpp"
#include "planner.hpp"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

namespace taskswap::tools {

struct plan_args {
  std::string config;
  std::string json;  ///< write the report here too
  std::optional<std::string> link_rate;
  std::optional<std::string> disk_read_rate;  ///< the drive of [storage] path, e.g. from `taskswap probe --storage`
  std::optional<std::string> disk_write_rate;
  std::optional<std::string> device_memory;
  std::optional<std::size_t> bytes_per_sample;  ///< default: the sample model's
  int steps = 0;  ///< steps of the schedule replayed (0: [model] steps)
  bool measure_link = false;
  bool measure_disk = false;  ///< measure the [storage] drive's rates (64 MiB unit file)
};

struct probe_args {
  std::string json;
  std::string size = "256 MiB";
  int repeats = 5;
  bool emulated = false;
  std::string storage;  // a directory: also measure the disk tier's unit files there
  std::string storage_size = "256 MiB";
};

struct headroom_args {
  std::string config;
  std::string json;
  std::string trace;
  std::optional<std::string> device_memory;
  int probe_steps = 3;
  int timed_steps = 12;
  int rounds = 3;  ///< timed runs per arm, alternating; the fastest counts
  bool progress = true;
};

int run_plan(const plan_args& args);
int run_probe(const probe_args& args);
int run_headroom(const headroom_args& args);

/// The configuration in `file`, or where `file` is empty the embedded default: samples/configs/cuda.toml
/// where there is a GPU, else samples/configs/emulated.toml. `name` says which was taken.
[[nodiscard]] multitask::configuration load_or_default(const std::string& file, std::string& name);

/// The device bytes the runtime's budget and the trainer's activations share: the emulated
/// device's memory, or the CUDA device's free memory now, capped by `cap` (given as a size), else
/// by [headroom] device_memory; 0 when unknown.
[[nodiscard]] std::size_t device_memory_for(const multitask::configuration& cfg, const std::optional<std::string>& cap);

/// The planner's input for the sample model of `cfg` over `steps` steps of rank 0's schedule.
[[nodiscard]] plan_input model_plan_input(const multitask::configuration& cfg, int steps, std::size_t device_memory);
/// The largest value for which `fits` holds (0: none): gallops up from `start` (doubling, to
/// `limit`) until one does not fit, then bisects to one (or, with `fraction` > 0, to within
/// 1/fraction of the result). @throws invalid_argument naming `what` when `limit` still fits
[[nodiscard]] std::int64_t largest_fitting(std::int64_t start, std::int64_t limit,
                                           const std::function<bool(std::int64_t)>& fits, std::int64_t fraction,
                                           const std::string& what);
/// With the trunk's activations offloaded, the budget a batch leaves of `memory`: what the
/// trainer's workspace does not take (in 256-byte steps; 0 where it takes it all).
[[nodiscard]] std::size_t offloaded_budget(const multitask::configuration& cfg, std::int64_t batch, int steps,
                                           std::size_t memory);
/// The planner's largest batch with the trunk's activations offloaded: the largest for which the
/// plan check passes, the activation blocks counted with the units, with the budget what the
/// workspace leaves of `memory` (offloaded_budget), or `budget` beside the workspace (0: none).
[[nodiscard]] std::int64_t offloaded_batch(const multitask::configuration& cfg, int steps, std::size_t memory,
                                           std::optional<std::size_t> budget = std::nullopt);

/// Host↔device copy rates measured with timing events, bytes per second.
struct copy_rates {
  double h2d = 0;
  double d2h = 0;
};
[[nodiscard]] copy_rates measure_copies(const device& dev, int numa_node, std::size_t bytes, int repeats);

/// The disk tier's unit-file rates on a directory's drive, as `taskswap probe --storage` measures them.
struct storage_rates {
  double read = 0;  ///< bytes per second
  double write = 0;
  bool direct = false;  ///< O_DIRECT there (false: buffered)
  std::size_t bytes = 0;  ///< the unit file's size
};
/// One unit file of `bytes` written (and synced), then read, whole, `repeats` times each, the best
/// pass, with the tier's default queue depth and block size; the file is removed afterwards.
[[nodiscard]] storage_rates measure_storage_rates(const std::filesystem::path& dir, std::size_t bytes, int repeats);

/// Writes `j` to `file` ("-": standard output).
void write_json(const nlohmann::json& j, const std::string& file);

}  // namespace taskswap::tools
