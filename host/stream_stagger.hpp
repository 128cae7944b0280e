// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where to start the arrays that one CPU pass streams through together (AdamW reads and writes
// master, m, v and the parameter copy and reads the gradients, all at the same index), so that no
// two of them lie a "round" distance apart.
//
// Why: on the development VM (AMD EPYC, Zen), AdamW over arrays exactly 256 MiB or 512 MiB apart
// runs at 0.70-0.77 of its speed on the same arrays 4 KiB further apart, and 384 MiB apart loses
// 13 %; 64 B or 256 B further apart does not help, 1 KiB does (docs/host.md has the sweep). The
// streams then compete for the same DRAM banks (the address bits that pick a bank are equal). Other
// CPUs alias at other powers of two (4 KiB store-to-load aliasing on Intel), so the rule here is
// generic: every pairwise distance between the starts of the streams must be at least 4 KiB away
// from a multiple of 64 KiB (hence from any larger power of two) and not a multiple of 4 KiB.
// Processing several vectors per stream per iteration, as DeepSpeed does, was measured too and did
// not help here; the layout is the fix.

#include <algorithm>
#include <cstddef>
#include <span>

namespace taskswap::detail {

/// Arrays smaller than this are not staggered: the distances among a unit's slabs then stay below
/// 32 MiB, where no aliasing was measured, and padding would cost more than 0.8 %.
inline constexpr std::size_t stagger_min_array_bytes = std::size_t{8} << 20;
/// The search window: a start moves at most this far (minus one step) past where it would be.
inline constexpr std::size_t stagger_window = std::size_t{64} << 10;

/// How clean a distance is: >= 1 when it is at least 4 KiB from every multiple of 64 KiB and
/// not a multiple of 4 KiB; smaller is worse, 0 for a multiple of 64 KiB.
[[nodiscard]] inline double stagger_score(std::size_t distance) noexcept
{
  const auto from_multiple = [&](std::size_t period) {
    const std::size_t r = distance % period;
    return static_cast<double>(std::min(r, period - r));
  };
  return std::min(from_multiple(stagger_window) / 4096.0, from_multiple(4096) / 256.0);
}

/// The first offset >= `at`, in steps of `step` bytes (a power of two <= 4 KiB), whose distance
/// from every offset in `earlier` is clean; where the window holds none (it always does for up to
/// four earlier arrays and steps of 256 B), the cleanest one in it. Offsets in `earlier` are <= at.
[[nodiscard]] inline std::size_t stagger_offset(std::span<const std::size_t> earlier, std::size_t at,
                                                std::size_t step) noexcept
{
  std::size_t best = at;
  double best_score = -1.0;
  for (std::size_t c = at; c < at + stagger_window; c += step) {
    double score = 2.0;
    for (const std::size_t e : earlier) { score = std::min(score, stagger_score(c - e)); }
    if (score >= 1.0) { return c; }
    if (score > best_score) {
      best = c;
      best_score = score;
    }
  }
  return best;
}

}  // namespace taskswap::detail
