// SPDX-License-Identifier: Apache-2.0
// The AVX-512 path (compiled with -mavx512f -mavx2 -mfma -mf16c; run only where the CPU has them).
#include "host/cpu_adamw_kernel.hpp"

#include <immintrin.h>

namespace taskswap::detail {
namespace {

struct avx512_lanes {
  static constexpr std::size_t width = 16;
  using reg = __m512;
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg load_bf16(const std::uint16_t* p)
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): intrinsic API
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg load_f16(const std::uint16_t* p)
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  static reg canonical(reg x)
  {
    const reg nan = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(canonical_nan_bits)));
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
  }
  // x is canonical (no NaN but 0x7FC00000), so the rounding below needs no NaN case.
  static void store_bf16(std::uint16_t* p, reg x)
  {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(std::uint16_t* p, reg x)
  {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

void cpu_adamw_range_avx512(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end,
                            bool grouped)
{
  adamw_range<avx512_lanes>(s, k, begin, end, grouped);
}

}  // namespace taskswap::detail
