// SPDX-License-Identifier: Apache-2.0
// torch.optim.AdamW on one element, in double: the reference the runtime tests compare a unit's
// home against after its updates.
#pragma once

#include <taskswap/taskswap.hpp>

#include <cmath>

namespace taskswap::test {

struct adamw_state {
  double p = 0;
  double m = 0;
  double v = 0;
};

// `steps` steps of gradient `g` from parameter `p` (m = v = 0 before the first).
inline adamw_state adamw_reference(double p, double g, int steps, const adamw_options& o)
{
  adamw_state s{.p = p};
  for (int t = 1; t <= steps; ++t) {
    s.p *= 1.0 - o.lr * o.weight_decay;
    s.m = o.beta1 * s.m + (1.0 - o.beta1) * g;
    s.v = o.beta2 * s.v + (1.0 - o.beta2) * g * g;
    const double m_hat = s.m / (1.0 - std::pow(o.beta1, t));
    const double v_hat = s.v / (1.0 - std::pow(o.beta2, t));
    s.p -= o.lr * m_hat / (std::sqrt(v_hat) + o.eps);
  }
  return s;
}

}  // namespace taskswap::test
