// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Optimizer hyperparameters, gradient clipping and loss scaling.

#include <cstdint>

namespace taskswap {

/// @brief AdamW with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.
struct adamw_options {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  /// Clip the gradients of the units a step trains by their global L2 norm (over every rank,
  /// after the reduction), as torch.nn.utils.clip_grad_norm_(max_norm = clip); 0: no clipping.
  /// Whether a runtime clips is fixed when it is made ([optimizer] clip > 0 or a loss scaler).
  double clip = 0.0;
};

/// @brief Dynamic loss scaling, as torch.cuda.amp.GradScaler: the trainer multiplies its loss by
/// the scale (runtime::loss_scale()); the runtime unscales the gradients in the update, skips
/// the update of every unit of a step in which any gradient is not finite (on any rank) and
/// backs the scale off, and grows it after growth_interval finite steps in a row.
struct loss_scaler_options {
  bool enabled = false;
  double init_scale = 65536.0;  ///< > 0
  double growth_factor = 2.0;  ///< > 1
  double backoff_factor = 0.5;  ///< in (0, 1)
  std::int64_t growth_interval = 2000;  ///< >= 1
};

/// @brief The loss scaler's state (runtime::scaler_state()).
struct loss_scaler_state {
  float scale = 1.0F;  ///< the loss scale of the next step
  std::int64_t growth_tracker = 0;  ///< finite steps in a row since the scale last changed
  std::int64_t skipped_steps = 0;  ///< steps skipped since the runtime started (this run)
  std::int64_t steps = 0;  ///< guarded steps finished since the runtime started (this run)
  bool last_skipped = false;  ///< the last finished step was skipped
  float last_norm = 0;  ///< the last finished step's global gradient norm (unscaled)
};

}  // namespace taskswap
