// SPDX-License-Identifier: Apache-2.0
#pragma once

// A unit's AdamW settings for one update (step_protocol.cpp, host_optimizer.cpp, step_guard.cpp).

#include "host/adamw_formula.hpp"

#include <taskswap/runtime.hpp>

namespace taskswap::detail {

/// The per-step scalars: with weight decay, and without (no-decay tensors).
struct update_scalars {
  adamw_scalars decay;
  adamw_scalars no_decay;
};

/// A guarded step's settings for a CPU AdamW, which turns them into scalars from the unit's step
/// count and the step's factors (a skipped step changes nothing): with weight decay, and without.
struct guarded_host_update {
  adamw_options decay;
  adamw_options plain;
};

}  // namespace taskswap::detail
