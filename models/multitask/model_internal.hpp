// SPDX-License-Identifier: Apache-2.0
#pragma once

// What model.cpp (configuration, units, workspace accounting) and trainer.cpp (the trainer)
// share: the workspace's buffers, their alignment, and the keys of the counter-based hash.

#include "model.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace multitask::detail {

inline constexpr std::size_t alignment = 256;  // of every workspace buffer

[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t a) noexcept { return (n + a - 1) / a * a; }

/// The hash key of (seed, a, b, c): the inputs, teachers, initial values and sampler draw from it.
[[nodiscard]] constexpr std::uint64_t key_of(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t c)
{
  return mix(seed ^ mix(a ^ mix(b ^ mix(c))));
}

enum : std::uint64_t { key_input = 1, key_teacher = 2, key_init = 3, key_sampler = 4, key_more_tasks = 5 };

/// The buffers of one batch: activations (per sample) first, then the fixed ones.
struct buffer_sizes {
  std::vector<std::size_t> per_sample;  // floats per sample of each per-sample buffer
  std::vector<std::size_t> fixed;  // floats of each fixed buffer
};

[[nodiscard]] buffer_sizes buffers_of(const model_config& m, int steps);

/// Every unit's initial values in its home master copy (init.cpp).
void initialise_homes(taskswap::runtime& rt, const model_config& m);

/// The log line of steps [first, end): the mean loss, the first tasks' means, the bytes reduced
/// (with several ranks); `losses` holds tasks_per_step per step (losses.cpp).
[[nodiscard]] std::string interval_line(const model_config& m, int rank, int world, const float* losses,
                                        std::int64_t first, std::int64_t end, std::size_t reduced_bytes);
/// Each task's losses over steps [begin, end_at) into r.tasks (sized), the mean of its first and last three.
void summarise_losses(const model_config& m, int rank, const float* losses, std::int64_t begin, std::int64_t end_at,
                      run_result& r);
/// The run's totals and the figures of its steps after `begin` (the warm-up).
void add_step_figures(taskswap::runtime& rt, std::int64_t begin, run_result& r);

}  // namespace multitask::detail
