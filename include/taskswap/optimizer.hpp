// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Optimizer hyperparameters.

namespace taskswap {

/// @brief AdamW with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.
struct adamw_options {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

}  // namespace taskswap
