// SPDX-License-Identifier: Apache-2.0
#pragma once

// Correctly rounded float operations that behave the same on the host and the device: one IEEE
// rounding each, never contracted or reassociated, NaN made canonical where a result is stored.
// The AdamW formula (host/adamw_formula.hpp), the dtype conversions, the kernels and the
// communicators' reductions all compute with these, so every path agrees to the bit.

#include <cstdint>

// Host code uses compiler builtins, not <cmath>: the vector translation units are compiled for
// AVX2 / AVX-512, and an out-of-line library inline from one of them must never be shared.
#if defined(__CUDACC__)
#define TASKSWAP_HOST_DEVICE __host__ __device__
#else
#define TASKSWAP_HOST_DEVICE
#endif

namespace taskswap::detail {

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

TASKSWAP_HOST_DEVICE static inline float add_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Double operations for the per-step scalars, computed on the host or (loss-scaled and clipped
// steps) in a one-thread kernel: one rounding each, never contracted into a fused multiply-add.
TASKSWAP_HOST_DEVICE static inline double dmul_rn(double a, double b)
{
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

TASKSWAP_HOST_DEVICE static inline double dadd_rn(double a, double b)
{
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

TASKSWAP_HOST_DEVICE static inline double ddiv_rn(double a, double b)
{
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

TASKSWAP_HOST_DEVICE static inline double dsqrt_rn(double a)
{
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(a);
#else
  return __builtin_sqrt(a);
#endif
}

/// x^n for n >= 0 by repeated squaring: the same correctly rounded multiplies on every path, so
/// the host and the device agree to the bit (a library pow need not).
TASKSWAP_HOST_DEVICE static inline double dpow_rn(double x, std::int64_t n)
{
  double result = 1.0;
  while (n > 0) {
    if ((n & 1) != 0) { result = dmul_rn(result, x); }
    x = dmul_rn(x, x);
    n >>= 1;
  }
  return result;
}

TASKSWAP_HOST_DEVICE static inline float canonical(float x) { return x != x ? bits_to_float(canonical_nan_bits) : x; }

}  // namespace taskswap::detail
