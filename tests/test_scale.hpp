// SPDX-License-Identifier: Apache-2.0
#pragma once

// Sizes of the large test cases. Under AddressSanitizer or ThreadSanitizer the element loops run
// 20-100x slower, so the largest cases shrink there; they still span several parallel chunks
// (64 Ki elements), so every path the full size takes is taken.

#include <cstddef>

namespace taskswap::test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool sanitized_build = true;
#else
inline constexpr bool sanitized_build = false;
#endif

/// `full` elements normally, `reduced` under a sanitizer.
constexpr std::size_t large_case(std::size_t full, std::size_t reduced) { return sanitized_build ? reduced : full; }

}  // namespace taskswap::test
