// SPDX-License-Identifier: Apache-2.0
#pragma once

// Rounding a size up to a multiple (alignments, granules, slabs), for every room.

#include <cstddef>

namespace taskswap::detail {

/// `n` rounded up to a multiple of `to` (> 0).
[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

}  // namespace taskswap::detail
