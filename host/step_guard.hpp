// SPDX-License-Identifier: Apache-2.0
#pragma once

// A guarded step: dynamic loss scaling (torch.cuda.amp.GradScaler) and global-norm clipping
// (torch.nn.utils.clip_grad_norm_) over every unit a step trains, decided on the device where
// the update runs there, so the host never waits for it. Written once for the CPU (the emulated
// device, host placement) and the CUDA kernels, so both agree to the bit:
//  - the square sum of the unscaled gradients runs over a fixed set of lanes (blocks x threads):
//    lane j adds the elements j, j + lanes, j + 2 lanes, ... in order, in double (a float's square
//    is exact in double, so a fused multiply-add changes nothing); the lanes are summed by a
//    fixed tree in each block, then the blocks by the same tree; the units' sums are added in
//    unit order. No atomics, so the result does not depend on scheduling;
//  - finishing the step (the norm, the clipping coefficient, the skip decision, the next scale)
//    and the AdamW scalars of each unit (from its step count, which a skipped step does not
//    advance) are computed by one thread with correctly rounded operations.

#include "host/adamw_formula.hpp"
#include "numeric/rounding.hpp"

#include <taskswap/optimizer.hpp>

#include <cstddef>
#include <cstdint>

namespace taskswap::detail {

/// The guarded step's state in device memory (one per runtime).
struct step_guard {
  double square_sum = 0;  // this step's unscaled gradients, unit by unit (reset when the step finishes)
  float scale = 1.0F;  // the loss scale the gradients of the current step carry
  float unscale = 1.0F;  // the finished step's 1 / scale, for its updates
  float clip_coef = 1.0F;  // the finished step's min(1, clip / (norm + 1e-6)); 1 without clipping
  float norm = 0;  // the finished step's global norm of the unscaled gradients
  std::int32_t skip = 0;  // the finished step is skipped: a gradient was not finite (with a scaler)
  std::int32_t growth_tracker = 0;  // finite steps since the scale last changed (GradScaler's)
  std::int64_t skipped_steps = 0;  // steps skipped since the start
  std::int64_t steps = 0;  // guarded steps finished since the start
};

/// What finishing a step needs from the options.
struct guard_settings {
  float clip = 0;  // max norm; 0: no clipping
  bool scaler = false;
  float growth_factor = 2.0F;
  float backoff_factor = 0.5F;
  std::int32_t growth_interval = 2000;
};

inline constexpr unsigned square_sum_threads = 256;  // per block; a power of two
inline constexpr unsigned square_sum_blocks = 256;  // a power of two
inline constexpr std::size_t square_sum_lanes = std::size_t{square_sum_threads} * square_sum_blocks;

/// GradScaler's inverse scale: scale.double().reciprocal().float().
TASKSWAP_HOST_DEVICE static inline float inverse_scale(float scale)
{
  return static_cast<float>(ddiv_rn(1.0, static_cast<double>(scale)));
}

/// One gradient's contribution: its unscaled value squared, exactly, in double.
TASKSWAP_HOST_DEVICE static inline double unscaled_square(float g, float unscale)
{
  const double x = mul_rn(g, unscale);
  return dmul_rn(x, x);
}

/// Ends a step's square sum: the norm, the clipping coefficient, whether the step is skipped and
/// the scale the next step uses (GradScaler.update: back off and reset the tracker after a
/// non-finite gradient; grow once growth_interval steps in a row were finite, if finite).
TASKSWAP_HOST_DEVICE static inline void finish_step_guard(step_guard& g, const guard_settings& k)
{
  const double sum = g.square_sum;
  const bool finite = sum - sum == 0.0;  // false for inf and NaN
  g.norm = static_cast<float>(dsqrt_rn(sum));
  g.clip_coef = 1.0F;
  if (k.clip > 0) {
    const float c = div_rn(k.clip, add_rn(g.norm, 1e-6F));
    g.clip_coef = c > 1.0F ? 1.0F : c;  // a NaN norm gives a NaN coefficient, as torch's clamp
  }
  g.unscale = inverse_scale(g.scale);
  g.skip = 0;
  if (k.scaler) {
    if (!finite) {
      g.skip = 1;
      g.scale = mul_rn(g.scale, k.backoff_factor);
      g.growth_tracker = 0;
      ++g.skipped_steps;
    } else if (g.growth_tracker + 1 >= k.growth_interval) {
      const float grown = mul_rn(g.scale, k.growth_factor);
      if (grown - grown == 0.0F) { g.scale = grown; }
      g.growth_tracker = 0;
    } else {
      ++g.growth_tracker;
    }
  }
  ++g.steps;
  g.square_sum = 0;
}

/// A unit's scalars for a guarded step: nothing (and its step count stays) when the step is
/// skipped; else its next step count, with the step's unscale and clipping factors.
/// `out[0]` with weight decay, `out[1]` without.
TASKSWAP_HOST_DEVICE static inline void prepare_guarded_scalars(const adamw_options& decay, const adamw_options& plain,
                                                                std::int64_t& step, const step_guard& g,
                                                                adamw_scalars* out)
{
  if (g.skip != 0) { return; }
  ++step;
  out[0] = make_adamw_scalars(decay, step);
  out[1] = make_adamw_scalars(plain, step);
  for (int i = 0; i < 2; ++i) {
    out[i].grad_unscale = g.unscale;
    out[i].grad_clip = g.clip_coef;
  }
}

}  // namespace taskswap::detail
