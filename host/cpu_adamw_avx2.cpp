// SPDX-License-Identifier: Apache-2.0
// The AVX2 path (compiled with -mavx2 -mfma -mf16c; run only where the CPU has all three).
#include "host/cpu_adamw_kernel.hpp"

#include <immintrin.h>

namespace taskswap::detail {
namespace {

struct avx2_lanes {
  static constexpr std::size_t width = 8;
  using reg = __m256;
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg load_bf16(const std::uint16_t* p)
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): intrinsic API
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg load_f16(const std::uint16_t* p)
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  static reg canonical(reg x)
  {
    const reg nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(canonical_nan_bits)));
    return _mm256_blendv_ps(x, nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  // x is canonical (no NaN but 0x7FC00000), so the rounding below needs no NaN case.
  static void store_bf16(std::uint16_t* p, reg x)
  {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_f16(std::uint16_t* p, reg x)
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

}  // namespace

void cpu_adamw_range_avx2(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end,
                          bool grouped)
{
  adamw_range<avx2_lanes>(s, k, begin, end, grouped);
}

}  // namespace taskswap::detail
