// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Element types of parameters and gradients.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace taskswap {

/// @brief The element type of a slab.
enum class dtype : std::uint8_t { f32, bf16, f16 };

/// @brief Bytes per element.
[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }

/// @brief "f32", "bf16" or "f16".
[[nodiscard]] constexpr std::string_view to_string(dtype t) noexcept
{
  return t == dtype::f32 ? "f32" : t == dtype::bf16 ? "bf16" : "f16";
}

}  // namespace taskswap
