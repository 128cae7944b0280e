// SPDX-License-Identifier: Apache-2.0
#pragma once

// The sample's multi-task model: a trunk of residual ReLU blocks (one unit each) and T task
// adapters (a two-layer MLP each, one unit each), trained on synthetic regression: task t's target
// is x · A_t for a fixed random teacher A_t, so every task's loss falls. The task of each step
// comes from a seeded sampler and is planned ahead. Used by the trainer (main.cpp) and by
// `taskswap headroom`, which needs the same units, activations and steps.

#include "ops.hpp"

#include <taskswap/taskswap.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace multitask {

/// The [model] table of a configuration.
struct model_config {
  int tasks = 16;
  int trunk_layers = 2;
  int width = 128;  ///< input and trunk width
  int adapter_hidden = 256;  ///< hidden width of each task adapter
  int outputs = 32;  ///< regression targets per sample
  taskswap::dtype compute = taskswap::dtype::f32;  ///< f32 or bf16 parameters; activations are f32
  int batch = 256;
  /// Tasks trained in each step over one pass of the trunk: the batch's rows are split among
  /// them (task j of k takes rows [j·batch/k, (j+1)·batch/k)), each through its own adapter, and
  /// the step's loss is the sum of the tasks' mean losses. 1..tasks, at most the batch.
  int tasks_per_step = 1;
  int steps = 200;
  std::uint64_t seed = 1;
  int log_every = 50;  ///< steps between loss lines (0: none)
  int plan_window = 32;  ///< steps planned at a time
  /// From this step on the trunk is used frozen (forward only: no gradients, no reduction, no
  /// update) and only the task adapters train: a per-task fine-tuning phase. 0: never.
  int freeze_trunk_after = 0;
  /// [activations] offload = "host": each trunk layer's input and branch are activation blocks
  /// of the runtime (unit_spec::activation), stashed after the layer's forward and brought back
  /// for its backward, in the budget beside the parameters instead of the trainer's workspace.
  bool offload_activations = false;
  [[nodiscard]] bool trunk_frozen(std::int64_t step) const noexcept
  {
    return freeze_trunk_after > 0 && step >= freeze_trunk_after;
  }
};

/// The runtime options and the model of one configuration file.
struct configuration {
  taskswap::runtime_options runtime;
  model_config model;
  /// [headroom] device_memory: the device bytes `taskswap headroom` lets the budget and the
  /// activations share (on a GPU, less than its memory keeps the search short). 0: all of it.
  std::size_t headroom_device_memory = 0;
};

/// Reads a configuration: the runtime's sections and [model].
/// @throws taskswap::config_error naming the file, line and key
[[nodiscard]] configuration load_configuration(const std::filesystem::path& file);
/// The same from text; `source` names it in errors.
[[nodiscard]] configuration parse_configuration(std::string_view text, std::string_view source);

/// The units of the model, trunk first ("trunk/0", …, "task/0", …), then with offloaded
/// activations each layer's two blocks of `batch` rows ("act/0/input", "act/0/branch", …).
[[nodiscard]] std::vector<taskswap::unit_spec> model_units(const model_config& m, int batch);
[[nodiscard]] inline std::vector<taskswap::unit_spec> model_units(const model_config& m)
{
  return model_units(m, m.batch);
}

/// The task each step of `rank` trains: a counter-based sample, so any window can be produced alone.
[[nodiscard]] int task_of_step(const model_config& m, int rank, std::int64_t step);
/// The tasks_per_step distinct tasks of a step, in the order its rows take them: task_of_step's
/// first, then further counter-based draws.
[[nodiscard]] std::vector<int> tasks_of_step(const model_config& m, int rank, std::int64_t step);
/// The first of the rows of part `j` of `parts` in a batch of `rows` (j = parts: the end).
[[nodiscard]] constexpr int rows_begin(int rows, int parts, int j) noexcept
{
  return static_cast<int>(static_cast<std::int64_t>(rows) * j / parts);
}

/// Device bytes the trainer allocates beside the runtime's budget for a batch and a number of
/// steps: fixed + batch × per_sample (each buffer rounded to 256 bytes, counted in `fixed`).
struct workspace_size {
  std::size_t fixed = 0;
  std::size_t per_sample = 0;
  [[nodiscard]] std::size_t bytes(std::size_t batch) const noexcept { return fixed + batch * per_sample; }
};
[[nodiscard]] workspace_size model_workspace(const model_config& m, int steps);

/// Options with every unit pinned and the budget exactly the units' device bytes: the
/// all-resident baseline of the same model.
[[nodiscard]] taskswap::runtime_options all_resident(const taskswap::runtime_options& options,
                                                     const std::vector<taskswap::unit_spec>& units);

/// Per-task losses, as they are read back from the device.
struct task_losses {
  std::int64_t steps = 0;
  float first = 0;  ///< mean over the task's first few steps
  float last = 0;  ///< mean over its last few steps
  std::vector<float> all;
};

/// What a training run did.
struct run_result {
  std::vector<task_losses> tasks;
  double seconds = 0;  ///< wall time of the steps (after the first, which warms up)
  std::int64_t timed_steps = 0;
  taskswap::step_stats total{};  ///< every step
  taskswap::step_stats timed{};  ///< the steps after the first (transfers, stall)
  int stopped_by = 0;  ///< the agreed stop code when the run stopped early (0: it did not)
  double stop_agreement_seconds = 0;  ///< host time in runtime::agree_stop over the timed steps
  std::int64_t steps_done = 0;  ///< the steps done in all when run() returned
  std::int64_t first_step = 0;  ///< where the run started (a resumed run: its checkpoint's step)
  std::optional<taskswap::loss_scaler_state> scaler;  ///< with loss scaling or clipping
  taskswap::disk_stats disk{};  ///< the disk home tier's host cache (zeros without disk homes)
  std::uint64_t disk_read_in_steps = 0;  ///< unit-file bytes read during the steps (not the set-up, not the last flush)
  std::uint64_t disk_written_in_steps = 0;  ///< … and written
  [[nodiscard]] double step_ms() const
  {
    return timed_steps == 0 ? 0 : seconds * 1e3 / static_cast<double>(timed_steps);
  }
};

/// How many steps before the end of the planned window the trainer plans the next one: the
/// largest prefetch lookahead of the units (and [storage] lookahead, with disk homes) plus one
/// (at most the window), so that prefetching never stops at a window's end. Every rank computes the same.
[[nodiscard]] int plan_margin(const model_config& m, const taskswap::runtime_options& options);

/// Whether the trainer streams its trunk within each step: the trunk is not pinned. With a
/// communicator too: a layer's forward is a frozen use that gives its room back at release; its
/// trained use (backward) keeps its room until its gradient bucket's reduction is launched
/// ([comm] bucket_cap near a layer's gradients: at its release).
[[nodiscard]] bool trunk_streams(const model_config& m, const taskswap::runtime_options& options);

/// Step `step`'s plan as the trainer makes its calls: the trunk (`trunk`, forward order) and the
/// step's adapters (in its tasks' order). Held: the trunk, then the adapters, all to the step's
/// end. Streamed: each layer for its forward (its parameters alone) and released; each adapter,
/// released (stepped) before the next; then, unless the trunk is frozen at this step, each layer,
/// last first, for its backward. With activation blocks (`blocks`: each layer's input, then its
/// branch) and a trunk not frozen at this step: at layer l of the forward its input and its
/// branch stashed and released; in the backward, the two read (frozen) and released.
[[nodiscard]] taskswap::step_plan step_plan_of(const model_config& m, std::span<const taskswap::unit_id> trunk,
                                               std::span<const taskswap::unit_id> adapters, std::int64_t step,
                                               bool streamed, std::span<const taskswap::unit_id> blocks = {});

/// What run() does besides training.
struct run_options {
  std::function<void(const std::string&)> on_log;  ///< a line every log_every steps
  std::filesystem::path checkpoint;  ///< where to save checkpoints (empty: none)
  int checkpoint_every = 0;  ///< steps between checkpoints (0: only at the end)
  std::int64_t stop_after = -1;  ///< end after this step count in all (an interruption)
  /// This rank's reason to stop, asked at every step boundary (e.g. stop_signals::signal(); 0: go
  /// on). The ranks agree on it (runtime::agree_stop): all stop at the same step and save.
  std::function<int()> stop_code;
};

/// The trainer: the runtime, the model's workspace for one batch size, and the step.
class trainer {
 public:
  /// Builds the runtime over `units` (collectively, when `comm` is given) and the workspace.
  /// @throws taskswap::out_of_memory when the budget or the workspace does not fit the device
  trainer(const taskswap::device& dev, const taskswap::runtime_options& options, const model_config& model, int batch,
          int steps, std::shared_ptr<taskswap::communicator> comm = nullptr);
  ~trainer();
  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;

  /// Restores a checkpoint (before run()): the units' state and the step to continue from.
  /// @throws taskswap::checkpoint_error when it is not a checkpoint of this model and seed
  std::int64_t resume(const std::filesystem::path& checkpoint);

  /// Runs the steps from the first not done (0, or the resumed position) to `steps`; `on_log`
  /// gets a line every log_every steps (the losses lag by one interval, so that reading them never
  /// waits for the device).
  run_result run(const run_options& options);
  run_result run(const std::function<void(const std::string&)>& on_log = {})
  {
    run_options o;
    o.on_log = on_log;
    return run(o);
  }

  /// Flushes and writes every unit's home slabs (params, master, m, v) to `file`.
  void save_parameters(const std::filesystem::path& file);

  [[nodiscard]] taskswap::runtime& get_runtime() noexcept;
  [[nodiscard]] int rank() const noexcept;
  [[nodiscard]] int world() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace multitask
