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
// Per element, with g the gradient converted exactly to float:
//   m' = fma(beta1, m, (1 - beta1) * g)
//   v' = fma(beta2, v, ((1 - beta2) * g) * g)
//   d  = fma(sqrt(v'), 1 / sqrt(1 - beta2^t), eps)
//   p' = fma(-lr / (1 - beta1^t), m' / d, p * (1 - lr * weight_decay))
// A non-finite gradient makes that element's m', v' non-finite and p' NaN (as torch does);
// loss-scaled training skips such steps with the unscale-and-check kernel.

#include <taskswap/dtype.hpp>
#include <taskswap/optimizer.hpp>

#include <cstddef>
#include <cstdint>

// Host code uses compiler builtins, not <cmath>: the vector translation units are compiled for
// AVX2 / AVX-512, and an out-of-line library inline from one of them must never be shared.
#if defined(__CUDACC__)
#define TASKSWAP_HOST_DEVICE __host__ __device__
#else
#define TASKSWAP_HOST_DEVICE
#endif

namespace taskswap::detail {

/// The per-step scalars, identical on every path.
struct adamw_scalars {
  float decay;            // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_step_size;    // -lr / (1 - beta1^t)
  float inv_sqrt_bias2;   // 1 / sqrt(1 - beta2^t)
  float eps;
};

/// Scalars for step `step` (1 for the first update). Host only; checks happen in the caller.
adamw_scalars make_adamw_scalars(const adamw_options& o, std::int64_t step);

inline constexpr std::uint32_t canonical_nan_bits = 0x7FC00000U;
inline constexpr std::uint16_t canonical_bf16_nan = 0x7FC0U;
inline constexpr std::uint16_t canonical_f16_nan = 0x7E00U;

// Static: each translation unit (portable, AVX2, AVX-512, CUDA) keeps its own copy, so code built
// for one instruction set is never linked into another's path.
TASKSWAP_HOST_DEVICE static inline float bits_to_float(std::uint32_t u)
{
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

TASKSWAP_HOST_DEVICE static inline std::uint32_t float_to_bits(float f)
{
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TASKSWAP_HOST_DEVICE static inline float fma_rn(float a, float b, float c)
{
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

TASKSWAP_HOST_DEVICE static inline float mul_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

TASKSWAP_HOST_DEVICE static inline float div_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TASKSWAP_HOST_DEVICE static inline float sqrt_rn(float a)
{
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

TASKSWAP_HOST_DEVICE static inline float canonical(float x)
{
  return x != x ? bits_to_float(canonical_nan_bits) : x;
}

/// One element of the update; master, m and v are updated in place.
TASKSWAP_HOST_DEVICE static inline void adamw_element(float g, float& master, float& m, float& v,
                                                      const adamw_scalars& s)
{
  m = fma_rn(s.beta1, m, mul_rn(s.one_minus_beta1, g));
  v = fma_rn(s.beta2, v, mul_rn(mul_rn(s.one_minus_beta2, g), g));
  const float denom = fma_rn(sqrt_rn(v), s.inv_sqrt_bias2, s.eps);
  master = fma_rn(s.neg_step_size, div_rn(m, denom), mul_rn(master, s.decay));
  m = canonical(m);
  v = canonical(v);
  master = canonical(master);
}

// --- conversions (exact widening; round-to-nearest-even narrowing) ---------------

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
  }
}

}  // namespace taskswap::detail
