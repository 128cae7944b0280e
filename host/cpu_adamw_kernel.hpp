// SPDX-License-Identifier: Apache-2.0
#pragma once

// The AdamW loop over [begin, end), written once over a vector-operations type V (width lanes).
// Included only by cpu_adamw_{portable,avx2,avx512}.cpp, each compiled for its instruction set;
// everything here has internal linkage, so no code of one set is linked into another's path.
// Lanes perform exactly the scalar formula's operations (adamw_formula.hpp), so all paths agree
// to the bit; the scalar loop finishes the tail.

#include "host/adamw_formula.hpp"
#include "host/adamw_slabs.hpp"

#include <cstdint>

namespace taskswap::detail {
namespace {

enum class param_copy { none, bf16, f16 };

template <typename V, dtype G>
inline typename V::reg load_grad_vector(const void* grad, std::size_t i)
{
  if constexpr (G == dtype::f32) {
    return V::load(static_cast<const float*>(grad) + i);
  } else if constexpr (G == dtype::bf16) {
    return V::load_bf16(static_cast<const std::uint16_t*>(grad) + i);
  } else {
    return V::load_f16(static_cast<const std::uint16_t*>(grad) + i);
  }
}

// Scaled: the gradients are unscaled and clipped first (a guarded step); the plain loop is the
// one without those two multiplies (exact at 1, so both give the same bits at factors of 1).
template <typename V, dtype G, param_copy P, bool Scaled>
void adamw_loop(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end)
{
  std::size_t i = begin;
  if constexpr (V::width > 1) {
    const auto beta1 = V::set1(k.beta1);
    const auto one_minus_beta1 = V::set1(k.one_minus_beta1);
    const auto beta2 = V::set1(k.beta2);
    const auto one_minus_beta2 = V::set1(k.one_minus_beta2);
    const auto inv_sqrt_bias2 = V::set1(k.inv_sqrt_bias2);
    const auto eps = V::set1(k.eps);
    const auto neg_step_size = V::set1(k.neg_step_size);
    const auto decay = V::set1(k.decay);
    const auto grad_unscale = V::set1(k.grad_unscale);
    const auto grad_clip = V::set1(k.grad_clip);
    for (; i + V::width <= end; i += V::width) {
      auto g = load_grad_vector<V, G>(s.grad, i);
      if constexpr (Scaled) { g = V::mul(V::mul(g, grad_unscale), grad_clip); }
      auto m = V::load(s.m + i);
      auto v = V::load(s.v + i);
      auto p = V::load(s.master + i);
      m = V::fma(beta1, m, V::mul(one_minus_beta1, g));
      v = V::fma(beta2, v, V::mul(V::mul(one_minus_beta2, g), g));
      const auto denom = V::fma(V::sqrt(v), inv_sqrt_bias2, eps);
      p = V::fma(neg_step_size, V::div(m, denom), V::mul(p, decay));
      m = V::canonical(m);
      v = V::canonical(v);
      p = V::canonical(p);
      V::store(s.m + i, m);
      V::store(s.v + i, v);
      V::store(s.master + i, p);
      if constexpr (P == param_copy::bf16) { V::store_bf16(static_cast<std::uint16_t*>(s.params) + i, p); }
      if constexpr (P == param_copy::f16) { V::store_f16(static_cast<std::uint16_t*>(s.params) + i, p); }
    }
  }
  for (; i < end; ++i) {
    adamw_element(widen_element(s.grad, G, i), s.master[i], s.m[i], s.v[i], k);
    if constexpr (P == param_copy::bf16) { static_cast<std::uint16_t*>(s.params)[i] = float_to_bf16(s.master[i]); }
    if constexpr (P == param_copy::f16) { static_cast<std::uint16_t*>(s.params)[i] = float_to_f16(s.master[i]); }
  }
}

template <typename V, dtype G, bool Scaled>
void adamw_for_grad(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end)
{
  if (s.params == nullptr) {
    adamw_loop<V, G, param_copy::none, Scaled>(s, k, begin, end);
  } else if (s.param_type == dtype::bf16) {
    adamw_loop<V, G, param_copy::bf16, Scaled>(s, k, begin, end);
  } else {
    adamw_loop<V, G, param_copy::f16, Scaled>(s, k, begin, end);
  }
}

template <typename V, bool Scaled>
void adamw_range_of(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end)
{
  switch (s.grad_type) {
    case dtype::f32: adamw_for_grad<V, dtype::f32, Scaled>(s, k, begin, end); break;
    case dtype::bf16: adamw_for_grad<V, dtype::bf16, Scaled>(s, k, begin, end); break;
    case dtype::f16: adamw_for_grad<V, dtype::f16, Scaled>(s, k, begin, end); break;
  }
}

template <typename V>
void adamw_range(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end)
{
  if (k.grad_unscale != 1.0F || k.grad_clip != 1.0F) {
    adamw_range_of<V, true>(s, k, begin, end);
  } else {
    adamw_range_of<V, false>(s, k, begin, end);
  }
}

}  // namespace
}  // namespace taskswap::detail
