// SPDX-License-Identifier: Apache-2.0
#pragma once

// Conversions between the element types of slabs: exact widening to float, narrowing rounded to
// nearest even with one canonical NaN per type. Shared by the host code, the CUDA kernels and the
// communicators, so a bf16 or f16 value is the same bits wherever it was produced.

#include "numeric/rounding.hpp"

#include <taskswap/dtype.hpp>

#include <cstddef>
#include <cstdint>

namespace taskswap::detail {

TASKSWAP_HOST_DEVICE static inline float bf16_to_float(std::uint16_t h)
{
  return bits_to_float(static_cast<std::uint32_t>(h) << 16U);
}

TASKSWAP_HOST_DEVICE static inline std::uint16_t float_to_bf16(float f)
{
  const std::uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFU) > 0x7F800000U) { return canonical_bf16_nan; }
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16U) & 1U)) >> 16U);
}

TASKSWAP_HOST_DEVICE static inline float f16_to_float(std::uint16_t h)
{
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16U;
  const std::uint32_t exponent = (h >> 10U) & 0x1FU;
  const std::uint32_t mantissa = h & 0x3FFU;
  if (exponent == 0x1FU) { return bits_to_float(sign | 0x7F800000U | (mantissa << 13U)); }
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8F;
    return sign != 0 ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112U) << 23U) | (mantissa << 13U));
}

TASKSWAP_HOST_DEVICE static inline std::uint16_t float_to_f16(float f)
{
  const std::uint32_t u = float_to_bits(f);
  const std::uint32_t sign = (u >> 16U) & 0x8000U;
  const std::uint32_t magnitude = u & 0x7FFFFFFFU;
  if (magnitude > 0x7F800000U) { return canonical_f16_nan; }
  if (magnitude >= 0x477FF000U) { return static_cast<std::uint16_t>(sign | 0x7C00U); }  // >= 65520: inf
  if (magnitude < 0x38800000U) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24, rounded to nearest even.
    // The scaling by 2^24 is exact; the round-to-integer is the only rounding.
    const float scaled = bits_to_float(magnitude) * 16777216.0F;
#if defined(__CUDA_ARCH__)
    const float rounded = rintf(scaled);
#else
    const float rounded = __builtin_nearbyintf(scaled);
#endif
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(rounded));
  }
  const std::uint32_t rebased = magnitude - 0x38000000U;  // exponent 127 -> 15
  return static_cast<std::uint16_t>(sign | ((rebased + 0xFFFU + ((rebased >> 13U) & 1U)) >> 13U));
}

/// Element i of a slab of `type`, exactly widened to float.
TASKSWAP_HOST_DEVICE static inline float widen_element(const void* slab, dtype type, std::size_t i)
{
  switch (type) {
    case dtype::f32: return static_cast<const float*>(slab)[i];
    case dtype::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(slab)[i]);
    case dtype::f16: return f16_to_float(static_cast<const std::uint16_t*>(slab)[i]);
    case dtype::u8: break;  // raw bytes (a frozen unit's) are never widened
  }
  return 0.0F;
}

/// Stores x as element i of a slab of `type`, rounded to nearest even, NaN canonical.
TASKSWAP_HOST_DEVICE static inline void narrow_element(void* slab, dtype type, std::size_t i, float x)
{
  switch (type) {
    case dtype::f32: static_cast<float*>(slab)[i] = canonical(x); return;
    case dtype::bf16: static_cast<std::uint16_t*>(slab)[i] = float_to_bf16(x); return;
    case dtype::f16: static_cast<std::uint16_t*>(slab)[i] = float_to_f16(x); return;
    case dtype::u8: return;  // raw bytes (a frozen unit's) are never narrowed
  }
}

}  // namespace taskswap::detail
