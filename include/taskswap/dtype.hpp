// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Element types of parameters and gradients.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace taskswap {

/// @brief The element type of a slab.
///
/// f32, bf16 and f16 are what a trained unit holds. u8 is raw bytes: a frozen unit
/// (unit_spec::trainable false) whose tensors are of other or mixed element types (int8 weights
/// with a float scale, fp8) describes each tensor in bytes; the runtime moves those bytes and
/// never reads them.
enum class dtype : std::uint8_t { f32, bf16, f16, u8 };

/// @brief Bytes per element.
[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept { return t == dtype::f32 ? 4 : t == dtype::u8 ? 1 : 2; }

/// @brief Whether a unit of this type can be trained (f32, bf16, f16).
[[nodiscard]] constexpr bool is_floating(dtype t) noexcept { return t != dtype::u8; }

/// @brief "f32", "bf16", "f16" or "u8".
[[nodiscard]] constexpr std::string_view to_string(dtype t) noexcept
{
  return t == dtype::f32 ? "f32" : t == dtype::bf16 ? "bf16" : t == dtype::f16 ? "f16" : "u8";
}

}  // namespace taskswap
