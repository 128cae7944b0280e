// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The CPU AdamW on its own: step flat slabs on the CPU with the runtime's bitwise
/// semantics, without a runtime (as DeepSpeedCPUAdam users step their own tensors).

#include <taskswap/dtype.hpp>
#include <taskswap/optimizer.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace taskswap {

/// @brief Where the CPU AdamW runs.
struct cpu_adamw_options {
  int threads = 0;  ///< worker threads; 0 for every CPU of the node (or of the machine)
  int numa_node = -1;  ///< OS index of the node whose CPUs run the step; -1 for no constraint.
    ///< oneTBB places threads on a node only where it has its tbbbind library;
    ///< without it the constraint is logged once and ignored.
};

/// @brief The operands of one update: `master`, `m` and `v` are updated in place; `grad` holds
/// `master.size()` gradients of `grad_type`; `params`, when set, receives the updated parameters
/// rounded to `param_type` (bf16 or f16) in the same pass. No two may overlap.
struct adamw_tensors {
  std::span<float> master;  ///< fp32 parameters (the master copy)
  std::span<float> m;  ///< first moments, as many as master
  std::span<float> v;  ///< second moments, as many as master
  const void* grad = nullptr;  ///< f32, bf16 or f16, aligned to its element size
  dtype grad_type = dtype::f32;
  void* params = nullptr;  ///< optional compute copy, aligned to 2 bytes
  dtype param_type = dtype::bf16;
};

/// @brief A CPU AdamW (decoupled weight decay, torch.optim.AdamW's formula) over flat slabs,
/// vectorised with AVX-512 or AVX2 where the CPU has them and parallel over its threads. Its
/// results are bitwise those of the runtime's host and device optimizers for the same state,
/// gradients, hyperparameters and step, and bitwise independent of the thread count and of
/// the instruction set (docs/host.md#cpu-adamw).
///
/// For full memory speed, the arrays of one call should not start a round distance apart (256 MiB
/// is the worst case measured: 0.7 of the speed): separately allocated arrays are fine; arrays cut
/// back to back from one block are staggered as host/stream_stagger.hpp does. A step over such a
/// layout logs a warning once.
class cpu_adamw {
 public:
  /// @throws invalid_argument for a negative thread count or a node below -1
  explicit cpu_adamw(cpu_adamw_options options = {});
  ~cpu_adamw();
  cpu_adamw(cpu_adamw&&) noexcept;
  cpu_adamw& operator=(cpu_adamw&&) noexcept;
  cpu_adamw(const cpu_adamw&) = delete;
  cpu_adamw& operator=(const cpu_adamw&) = delete;

  /// @brief Updates `t` with step `step` of AdamW (1 for a tensor's first update: the bias
  /// corrections depend on it). Returns when every element is written.
  /// @throws config_error for hyperparameters the config loader would refuse (lr and eps
  ///         positive, weight_decay >= 0, betas in [0, 1), all finite)
  /// @throws invalid_argument for step < 1, sizes that differ, a null gradient, a params copy
  ///         in f32, misaligned or overlapping operands
  void step(const adamw_tensors& t, const adamw_options& hyper, std::int64_t step);

  [[nodiscard]] int threads() const;
  /// @brief The instruction set the steps use: "avx512", "avx2" or "portable".
  [[nodiscard]] std::string_view instruction_set() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// @brief Why `o` cannot be used, as "lr must be a positive number" (the key first), or an empty
/// string when it can. The config loader and cpu_adamw apply the same rules.
[[nodiscard]] std::string adamw_options_problem(const adamw_options& o);

}  // namespace taskswap
