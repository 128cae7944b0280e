// SPDX-License-Identifier: Apache-2.0
#pragma once

// The AdamW loop over [begin, end), written once over a vector-operations type V (width lanes).
// Included only by cpu_adamw_{portable,avx2,avx512}.cpp, each compiled for its instruction set;
// everything here has internal linkage, so no code of one set is linked into another's path.
// Lanes perform exactly the scalar formula's operations (adamw_formula.hpp), so all paths agree
// to the bit; the scalar loop finishes the tail.
//
// Note [Grouped stores]: a pass writes master, m, v (and the parameter copy) at the same index.
// Where those arrays start a round distance apart (a caller's slabs cut from one block, exactly
// 256 MiB apart), interleaving the stores of the three or four streams line by line ran the step
// at 0.27 of its speed on separate arrays on the development VM (AMD EPYC, AVX2, 2026-11-26), and
// grouping the reads did not help; writing each tile's results to a small buffer first and then
// each array's part of the tile in one run (tiles of 64 elements: 256 B per array) ran at 0.93
// and did not slow separate arrays (docs/host.md#array-layout). On an Intel Xeon VM, where packed
// arrays do not collapse, the grouped loop ran at 0.90-0.96 of the plain one's speed, so it is
// taken only for arrays of stagger_min_array_bytes or more whose starts are not staggered
// (grouped_stores): a caller's layout, which may alias. A unit's staggered slabs run the plain
// loop, and smaller passes run from the caches, where the extra copy cost 10-15 %.

#include "host/adamw_formula.hpp"
#include "host/adamw_slabs.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

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

// Where a loop writes its results: element i of the pass goes to index i - first of these.
struct adamw_out {
  float* master;
  float* m;
  float* v;
  void* params;
  std::size_t first;
};

// Scaled: the gradients are unscaled and clipped first (a guarded step); the plain loop is the
// one without those two multiplies (exact at 1, so both give the same bits at factors of 1).
template <typename V, dtype G, param_copy P, bool Scaled>
void adamw_loop(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end, const adamw_out& out)
{
  const std::size_t f = out.first;
  auto* const params_out = static_cast<std::uint16_t*>(out.params);
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
      V::store(out.m + (i - f), m);
      V::store(out.v + (i - f), v);
      V::store(out.master + (i - f), p);
      if constexpr (P == param_copy::bf16) { V::store_bf16(params_out + (i - f), p); }
      if constexpr (P == param_copy::f16) { V::store_f16(params_out + (i - f), p); }
    }
  }
  for (; i < end; ++i) {
    float p = s.master[i];
    float m = s.m[i];
    float v = s.v[i];
    adamw_element(widen_element(s.grad, G, i), p, m, v, k);
    out.master[i - f] = p;
    out.m[i - f] = m;
    out.v[i - f] = v;
    if constexpr (P == param_copy::bf16) { params_out[i - f] = float_to_bf16(p); }
    if constexpr (P == param_copy::f16) { params_out[i - f] = float_to_f16(p); }
  }
}

// The loop in tiles whose results go to a buffer first, then to each array in one run (Note
// [Grouped stores]).
template <typename V, dtype G, param_copy P, bool Scaled>
void adamw_grouped(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end)
{
  constexpr std::size_t tile = 64;  // a multiple of every width: the vector loop covers whole tiles
  alignas(64) float master[tile];
  alignas(64) float m[tile];
  alignas(64) float v[tile];
  alignas(64) std::uint16_t params[tile];
  for (std::size_t t = begin; t < end; t += tile) {
    const std::size_t last = std::min(end, t + tile);
    const std::size_t n = last - t;
    adamw_loop<V, G, P, Scaled>(s, k, t, last, adamw_out{master, m, v, params, t});
    std::memcpy(s.master + t, master, n * sizeof(float));
    std::memcpy(s.m + t, m, n * sizeof(float));
    std::memcpy(s.v + t, v, n * sizeof(float));
    if constexpr (P != param_copy::none) {
      std::memcpy(static_cast<std::uint16_t*>(s.params) + t, params, n * sizeof(std::uint16_t));
    }
  }
}

template <typename V, dtype G, param_copy P, bool Scaled>
void adamw_pass(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end, bool grouped)
{
  if (grouped) {
    adamw_grouped<V, G, P, Scaled>(s, k, begin, end);
  } else {
    adamw_loop<V, G, P, Scaled>(s, k, begin, end, adamw_out{s.master, s.m, s.v, s.params, 0});
  }
}

template <typename V, dtype G, bool Scaled>
void adamw_for_grad(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end, bool grouped)
{
  if (s.params == nullptr) {
    adamw_pass<V, G, param_copy::none, Scaled>(s, k, begin, end, grouped);
  } else if (s.param_type == dtype::bf16) {
    adamw_pass<V, G, param_copy::bf16, Scaled>(s, k, begin, end, grouped);
  } else {
    adamw_pass<V, G, param_copy::f16, Scaled>(s, k, begin, end, grouped);
  }
}

template <typename V, bool Scaled>
void adamw_range_of(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end, bool grouped)
{
  switch (s.grad_type) {
    case dtype::f32: adamw_for_grad<V, dtype::f32, Scaled>(s, k, begin, end, grouped); break;
    case dtype::bf16: adamw_for_grad<V, dtype::bf16, Scaled>(s, k, begin, end, grouped); break;
    case dtype::f16: adamw_for_grad<V, dtype::f16, Scaled>(s, k, begin, end, grouped); break;
    case dtype::u8: break;  // refused before any pass
  }
}

template <typename V>
void adamw_range(const adamw_slabs& s, const adamw_scalars& k, std::size_t begin, std::size_t end, bool grouped)
{
  if (k.grad_unscale != 1.0F || k.grad_clip != 1.0F) {
    adamw_range_of<V, true>(s, k, begin, end, grouped);
  } else {
    adamw_range_of<V, false>(s, k, begin, end, grouped);
  }
}

}  // namespace
}  // namespace taskswap::detail
