// SPDX-License-Identifier: Apache-2.0
// The portable path: the scalar formula, for CPUs without AVX2 + FMA + F16C.
#include "host/cpu_adamw_kernel.hpp"

namespace taskswap::detail {
namespace {
struct scalar_lanes {
  static constexpr std::size_t width = 1;
  using reg = float;
};
}  // namespace

void cpu_adamw_range_portable(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end,
                              bool grouped)
{
  adamw_range<scalar_lanes>(s, k, begin, end, grouped);
}

}  // namespace taskswap::detail
