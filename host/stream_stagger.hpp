// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where to start the arrays that one CPU pass streams through together (AdamW reads and writes
// master, m, v and the parameter copy and reads the gradients, all at the same index), so that no
// two of them lie a "round" distance apart.
//
// Why: on the development VM (AMD EPYC with AVX-512, 2 cores, 32 MiB L3; 2026-11-25), AdamW at one
// thread over arrays packed exactly 128, 256, 384, 512 MiB ... apart runs at 0.33-0.6 of its
// speed on separately mapped arrays (0.56-0.63 at two threads); moving each array 4.25 KiB further
// than the one before recovers 256 MiB and beyond, but 128 and 384 MiB stay at 0.74-0.87, and
// only 12 KiB or more between neighbours (pairwise distances at least 12 KiB from a multiple of
// 64 KiB) brings every spacing to >= 0.9 (docs/host.md#array-layout has the sweep). The streams
// then compete for the same DRAM banks: the address bits that pick a bank are equal or close.
// Other CPUs alias at other powers of two (4 KiB store-to-load aliasing on Intel), so the rule is
// generic: every pairwise distance between the starts of the streams must be at least 12 KiB
// from a multiple of 64 KiB (hence from any larger power of two) and not within 256 B of a
// multiple of 4 KiB. Up to five streams fit: 5 x 12 KiB < 64 KiB.

#include <algorithm>
#include <cstddef>
#include <span>

namespace taskswap::detail {

/// Arrays smaller than this are not staggered: the distances among a unit's slabs then stay below
/// 40 MiB, where no aliasing was measured, and padding would cost more than 0.8 %.
inline constexpr std::size_t stagger_min_array_bytes = std::size_t{8} << 20;
/// The period the streams are spread over: a start moves at most this far (minus 256 B).
inline constexpr std::size_t stagger_window = std::size_t{64} << 10;
/// How far apart (modulo the window) the streams must start at least.
inline constexpr std::size_t stagger_min_gap = std::size_t{12} << 10;
/// Stream k starts k times this far into the window (modulo it) from stream 0: 12.75 KiB keeps
/// every pairwise distance of up to five streams >= 12.75 KiB from a multiple of 64 KiB and
/// >= 768 B from a multiple of 4 KiB (a sixth would land 256 B short of 64 KiB).
inline constexpr std::size_t stagger_step = 13056;
inline constexpr std::size_t stagger_max_streams = 5;

/// How clean a distance is: >= 1 when it is at least 12 KiB from every multiple of 64 KiB and at
/// least 256 B from every multiple of 4 KiB; smaller is worse, 0 for a multiple of 64 KiB.
[[nodiscard]] inline double stagger_score(std::size_t distance) noexcept
{
  const auto from_multiple = [&](std::size_t period) {
    const std::size_t r = distance % period;
    return static_cast<double>(std::min(r, period - r));
  };
  return std::min(from_multiple(stagger_window) / static_cast<double>(stagger_min_gap), from_multiple(4096) / 256.0);
}

/// Where stream `k` (0 < k < stagger_max_streams) of a pass starts: the first offset >= `at`
/// that lies k * stagger_step past stream 0's offset `first`, modulo the window. Offsets keep
/// stream 0's alignment modulo 256 B.
[[nodiscard]] inline std::size_t stagger_offset(std::size_t first, std::size_t at, std::size_t k) noexcept
{
  const std::size_t want = (first + k * stagger_step) % stagger_window;
  const std::size_t have = at % stagger_window;
  return at + (want + stagger_window - have) % stagger_window;
}

}  // namespace taskswap::detail
