// SPDX-License-Identifier: Apache-2.0
#pragma once

// The AdamW update, written once for the CPU optimizer (host/cpu_adamw*) and the CUDA kernel
// (kernels/). Both produce bitwise the same results because:
//  - the per-step scalars are computed here, on the host, in double, and rounded to float once;
//  - every element goes through the same sequence of correctly rounded IEEE float operations:
//    multiplies, fused multiply-adds, one division, one square root; nothing is contracted or
//    reassociated (-ffp-contract=off on the host; __fmul_rn/__fmaf_rn/__fdiv_rn/__fsqrt_rn on the
//    device), and no flush-to-zero on either side;
//  - NaN results are canonical (0x7FC00000), and conversions to bf16/fp16 round to nearest even
//    with one canonical NaN each, so no payload bits depend on the hardware.
// The vector paths (AVX2, AVX-512) perform the same operations lane by lane.
//
// Per element, with g the gradient converted exactly to float and then unscaled and clipped
// (torch's GradScaler.unscale_ and clip_grad_norm_: two float multiplies, each exact at 1):
//   g  = (g * grad_unscale) * grad_clip
//   m' = fma(beta1, m, (1 - beta1) * g)
//   v' = fma(beta2, v, ((1 - beta2) * g) * g)
//   d  = fma(sqrt(v'), 1 / sqrt(1 - beta2^t), eps)
//   p' = fma(-lr / (1 - beta1^t), m' / d, p * (1 - lr * weight_decay))
// A non-finite gradient makes that element's m', v' non-finite and p' NaN (as torch does);
// loss-scaled training skips such steps (step_guard.hpp: the whole step is skipped on the device).

#include "numeric/dtype_conversion.hpp"
#include "numeric/rounding.hpp"

#include <taskswap/dtype.hpp>
#include <taskswap/optimizer.hpp>

#include <cstddef>
#include <cstdint>

namespace taskswap::detail {

/// The per-step scalars, identical on every path.
struct adamw_scalars {
  float decay;  // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float inv_sqrt_bias2;  // 1 / sqrt(1 - beta2^t)
  float eps;
  float grad_unscale = 1.0F;  // 1 / the loss scale (1: none)
  float grad_clip = 1.0F;  // the global-norm clipping coefficient (1: none)
};

/// Scalars for step `step` (1 for the first update); checks happen in the caller. The same
/// correctly rounded double operations on the host and in the device's one-thread kernel.
TASKSWAP_HOST_DEVICE static inline adamw_scalars make_adamw_scalars(const adamw_options& o, std::int64_t step)
{
  const double bias1 = dadd_rn(1.0, -dpow_rn(o.beta1, step));
  const double bias2 = dadd_rn(1.0, -dpow_rn(o.beta2, step));
  return {static_cast<float>(dadd_rn(1.0, -dmul_rn(o.lr, o.weight_decay))),
          static_cast<float>(o.beta1),
          static_cast<float>(dadd_rn(1.0, -o.beta1)),
          static_cast<float>(o.beta2),
          static_cast<float>(dadd_rn(1.0, -o.beta2)),
          static_cast<float>(ddiv_rn(-o.lr, bias1)),
          static_cast<float>(ddiv_rn(1.0, dsqrt_rn(bias2))),
          static_cast<float>(o.eps)};
}

/// One element of the update; master, m and v are updated in place.
TASKSWAP_HOST_DEVICE static inline void adamw_element(float g, float& master, float& m, float& v,
                                                      const adamw_scalars& s)
{
  g = mul_rn(mul_rn(g, s.grad_unscale), s.grad_clip);
  m = fma_rn(s.beta1, m, mul_rn(s.one_minus_beta1, g));
  v = fma_rn(s.beta2, v, mul_rn(mul_rn(s.one_minus_beta2, g), g));
  const float denom = fma_rn(sqrt_rn(v), s.inv_sqrt_bias2, s.eps);
  master = fma_rn(s.neg_step_size, div_rn(m, denom), mul_rn(master, s.decay));
  m = canonical(m);
  v = canonical(v);
  master = canonical(master);
}

}  // namespace taskswap::detail
