// SPDX-License-Identifier: Apache-2.0
// The CPU AdamW against a double-precision reference, and bitwise across instruction sets and
// thread counts. The reference runs the same formula in double from the same float state and
// scalars, so each step's float result must lie within a few ulps of it.

#include "host/cpu_adamw.hpp"
#include "host/stream_stagger.hpp"
#include "test_scale.hpp"
#include "test_seed.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

using detail::adamw_scalars;
using detail::adamw_slabs;
using detail::cpu_isa;

std::vector<cpu_isa> available_isas()
{
  std::vector<cpu_isa> isas{cpu_isa::portable};
  if (detail::best_cpu_isa() != cpu_isa::portable) { isas.push_back(cpu_isa::avx2); }
  if (detail::best_cpu_isa() == cpu_isa::avx512) { isas.push_back(cpu_isa::avx512); }
  return isas;
}

// One unit's state: fp32 master, moments, gradients of the given type, an optional param copy.
struct unit_state {
  unit_state(std::size_t n, dtype grad, std::optional<dtype> param)
      : master(n), m(n), v(n), grad16(n), grad32(n), params(param ? n : 0), grad_type(grad), param_type(param)
  {}
  std::vector<float> master, m, v;
  std::vector<std::uint16_t> grad16;
  std::vector<float> grad32;
  std::vector<std::uint16_t> params;
  dtype grad_type;
  std::optional<dtype> param_type;

  adamw_slabs slabs()
  {
    adamw_slabs s;
    s.master = master.data();
    s.m = m.data();
    s.v = v.data();
    s.grad = grad_type == dtype::f32 ? static_cast<const void*>(grad32.data()) : grad16.data();
    s.grad_type = grad_type;
    s.params = param_type ? params.data() : nullptr;
    s.param_type = param_type.value_or(dtype::bf16);
    s.count = master.size();
    return s;
  }
  float gradient(std::size_t i) const
  {
    switch (grad_type) {
      case dtype::f32: return grad32[i];
      case dtype::bf16: return detail::bf16_to_float(grad16[i]);
      case dtype::f16: return detail::f16_to_float(grad16[i]);
      case dtype::u8: break;  // not a gradient type
    }
    return 0;
  }
  void fresh_gradients(std::mt19937_64& gen, double scale)
  {
    std::normal_distribution<float> normal(0.0F, static_cast<float>(scale));
    for (std::size_t i = 0; i < master.size(); ++i) {
      const float g = normal(gen);
      grad32[i] = g;
      grad16[i] = grad_type == dtype::bf16 ? detail::float_to_bf16(g) : detail::float_to_f16(g);
    }
  }
};

unit_state random_unit(std::size_t n, dtype grad, std::optional<dtype> param, std::mt19937_64& gen)
{
  unit_state u(n, grad, param);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::size_t i = 0; i < n; ++i) {
    u.master[i] = 0.2F * normal(gen);
    u.m[i] = 1e-3F * normal(gen);
    u.v[i] = 1e-6F * std::abs(normal(gen));
  }
  std::fill(u.params.begin(), u.params.end(), std::uint16_t{0xDEAD});  // poison
  u.fresh_gradients(gen, 1e-2);
  return u;
}

bool within_ulps(float got, double want, double scale, int ulps)
{
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::abs(scale), 1e-30)) - 23);
  return std::abs(static_cast<double>(got) - want) <= ulps * ulp;
}

// The nearest bf16 to x, ties to even, found by comparing the two neighbours (not by bit tricks).
std::uint16_t nearest_bf16(float x)
{
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const auto down = static_cast<std::uint16_t>(u >> 16);
  const auto up = static_cast<std::uint16_t>(down + 1);
  const double d_down = std::abs(static_cast<double>(x) - detail::bf16_to_float(down));
  const double d_up = std::abs(static_cast<double>(x) - detail::bf16_to_float(up));
  if (d_down != d_up) { return d_down < d_up ? down : up; }
  return (down & 1U) == 0 ? down : up;
}

float mul_f32(float a, float b) { return a * b; }

void expect_step_matches_reference(const unit_state& before, const unit_state& after, const adamw_scalars& k)
{
  for (std::size_t i = 0; i < before.master.size(); ++i) {
    // The gradient unscaled and clipped in float first (two roundings, as the formula does).
    const double g = mul_f32(mul_f32(static_cast<float>(before.gradient(i)), k.grad_unscale), k.grad_clip);
    const double m = static_cast<double>(k.beta1) * before.m[i] + static_cast<double>(k.one_minus_beta1) * g;
    const double v = static_cast<double>(k.beta2) * before.v[i] + static_cast<double>(k.one_minus_beta2) * g * g;
    const double denom = std::sqrt(static_cast<double>(after.v[i])) * k.inv_sqrt_bias2 + k.eps;
    const double decayed = static_cast<double>(before.master[i]) * k.decay;
    const double update = static_cast<double>(k.neg_step_size) * (static_cast<double>(after.m[i]) / denom);
    const double p = decayed + update;
    // Error bounds: each rounding costs half an ulp of the term it rounds.
    const double m_scale = std::abs(k.beta1 * static_cast<double>(before.m[i])) + std::abs(k.one_minus_beta1 * g);
    const double v_scale = std::abs(k.beta2 * static_cast<double>(before.v[i])) + std::abs(k.one_minus_beta2 * g * g);
    ASSERT_TRUE(within_ulps(after.m[i], m, m_scale, 2)) << "m at " << i << ": " << after.m[i] << " vs " << m;
    ASSERT_TRUE(within_ulps(after.v[i], v, v_scale, 3)) << "v at " << i << ": " << after.v[i] << " vs " << v;
    ASSERT_TRUE(within_ulps(after.master[i], p, std::abs(decayed) + std::abs(update), 4))
      << "master at " << i << ": " << after.master[i] << " vs " << p;
    if (after.param_type == dtype::bf16) {
      ASSERT_EQ(after.params[i], nearest_bf16(after.master[i])) << "bf16 copy at " << i;
    } else if (after.param_type == dtype::f16) {
      const auto reference = static_cast<_Float16>(after.master[i]);
      ASSERT_EQ(after.params[i], std::bit_cast<std::uint16_t>(reference)) << "f16 copy at " << i;
    }
  }
}

struct case_name {
  std::string operator()(const ::testing::TestParamInfo<std::tuple<dtype, int>>& info) const
  {
    const int p = std::get<1>(info.param);
    return std::string(to_string(std::get<0>(info.param))) + "_grads_" +
           (p == 0   ? "no_copy"
            : p == 1 ? "bf16_copy"
                     : "f16_copy");
  }
};

class cpu_adamw : public ::testing::TestWithParam<std::tuple<dtype, int>> {
 protected:
  std::optional<dtype> param_type() const
  {
    const int p = std::get<1>(GetParam());
    return p == 0 ? std::nullopt : std::optional<dtype>(p == 1 ? dtype::bf16 : dtype::f16);
  }
};

TEST_P(cpu_adamw, MatchesDoubleReferenceOverManyStepsOnEveryPath)
{
  const std::uint64_t seed = test_seed();
  std::mt19937_64 gen{seed};
  SCOPED_TRACE("seed " + std::to_string(seed) + " (TASKSWAP_TEST_SEED to replay)");
  const adamw_options options{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  detail::host_task_arena threads(-1, 2);
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{15}, std::size_t{17}, std::size_t{1023},
                              large_case((std::size_t{1} << 20) + 3, (std::size_t{3} << 16) + 3)}) {
    SCOPED_TRACE("n " + std::to_string(n));
    unit_state unit = random_unit(n, std::get<0>(GetParam()), param_type(), gen);
    for (std::int64_t step = 1; step <= 4; ++step) {
      adamw_scalars k = detail::make_adamw_scalars(options, step);
      if (step >= 3) {  // a guarded step's factors: 1 / the loss scale, a clipping coefficient
        k.grad_unscale = 1.0F / 1024.0F;
        k.grad_clip = 0.37F;
      }
      const unit_state before = unit;
      std::vector<unit_state> results;
      for (const cpu_isa isa : available_isas()) {
        for (const bool grouped : {false, true}) {  // the stores in lockstep, or grouped by tile
          unit_state run = before;
          detail::cpu_adamw_step(run.slabs(), k, threads, isa, grouped);
          results.push_back(std::move(run));
        }
      }
      expect_step_matches_reference(before, results.front(), k);
      if (HasFatalFailure()) { return; }
      for (std::size_t r = 1; r < results.size(); ++r) {
        ASSERT_EQ(results[r].master, results.front().master) << "path " << r << " differs in master";
        ASSERT_EQ(results[r].m, results.front().m);
        ASSERT_EQ(results[r].v, results.front().v);
        ASSERT_EQ(results[r].params, results.front().params);
      }
      unit = results.back();
      unit.fresh_gradients(gen, step % 2 == 0 ? 1e-2 : 3.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(dtypes, cpu_adamw,
                         ::testing::Combine(::testing::Values(dtype::f32, dtype::bf16, dtype::f16),
                                            ::testing::Values(0, 1, 2)),
                         case_name{});

TEST(cpu_adamw_determinism, BitwiseIndependentOfThreadCount)
{
  const std::uint64_t seed = test_seed();
  std::mt19937_64 gen{seed};
  SCOPED_TRACE("seed " + std::to_string(seed) + " (TASKSWAP_TEST_SEED to replay)");
  const adamw_scalars k = detail::make_adamw_scalars({}, 3);
  const unit_state start =
    random_unit(large_case((std::size_t{3} << 20) + 11, (std::size_t{5} << 16) + 11), dtype::bf16, dtype::bf16, gen);
  std::vector<unit_state> results;
  for (const int thread_count : {1, 2, 3, 8}) {
    detail::host_task_arena arena(-1, thread_count);
    unit_state run = start;
    detail::cpu_adamw_step(run.slabs(), k, arena);
    results.push_back(std::move(run));
  }
  for (std::size_t r = 1; r < results.size(); ++r) {
    EXPECT_EQ(results[r].master, results[0].master);
    EXPECT_EQ(results[r].params, results[0].params);
  }
}

TEST(cpu_adamw_determinism, NonFiniteGradientsPropagateCanonicallyAndStayLocal)
{
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> specials{nan, -nan, inf, -inf, 1e-40F, -0.0F, 3.0e38F};
  detail::host_task_arena arena(-1, 2);
  const adamw_scalars k = detail::make_adamw_scalars({}, 1);
  std::mt19937_64 gen{1234};
  for (const cpu_isa isa : available_isas()) {
    SCOPED_TRACE(std::string(detail::to_string(isa)));
    unit_state unit = random_unit(64, dtype::f32, dtype::f16, gen);
    for (std::size_t i = 0; i < specials.size(); ++i) { unit.grad32[i * 9] = specials[i]; }
    const unit_state before = unit;
    detail::cpu_adamw_step(unit.slabs(), k, arena, isa);
    for (std::size_t i = 0; i < 64; ++i) {
      const float g = before.grad32[i];
      if (std::isnan(g) || std::isinf(g)) {
        // NaN in: everything NaN. Inf in: m, v infinite, m/denom = inf/inf, so the master is NaN.
        EXPECT_EQ(std::bit_cast<std::uint32_t>(unit.master[i]), detail::canonical_nan_bits) << i;
        EXPECT_EQ(unit.params[i], detail::canonical_f16_nan) << i;
        if (std::isnan(g)) {
          EXPECT_EQ(std::bit_cast<std::uint32_t>(unit.m[i]), detail::canonical_nan_bits) << i;
          EXPECT_EQ(std::bit_cast<std::uint32_t>(unit.v[i]), detail::canonical_nan_bits) << i;
        } else {
          EXPECT_TRUE(std::isinf(unit.m[i]) && std::isinf(unit.v[i])) << i;
        }
      } else {
        EXPECT_TRUE(std::isfinite(unit.master[i])) << i << " (gradient " << g << ")";
      }
    }
  }
}

TEST(cpu_adamw_conversions, Bf16AndF16RoundToNearestEven)
{
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto half = static_cast<std::uint16_t>(h);
    const float reference = static_cast<float>(std::bit_cast<_Float16>(half));
    const float got = detail::f16_to_float(half);
    if (std::isnan(reference)) {
      ASSERT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(reference)) << h;
    }
  }
  std::mt19937 gen{99};
  for (std::size_t i = 0; i < large_case(4'000'000, 200'000); ++i) {
    // Uniform bit patterns cover subnormals, overflow to inf and ties.
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(gen()));
    const std::uint16_t f16 = detail::float_to_f16(x);
    const std::uint16_t bf16 = detail::float_to_bf16(x);
    if (std::isnan(x)) {
      ASSERT_EQ(f16, detail::canonical_f16_nan);
      ASSERT_EQ(bf16, detail::canonical_bf16_nan);
      continue;
    }
    ASSERT_EQ(f16, std::bit_cast<std::uint16_t>(static_cast<_Float16>(x))) << x;
    if (std::isfinite(x) && std::abs(x) < 3.38e38F) { ASSERT_EQ(bf16, nearest_bf16(x)) << x; }
  }
}

TEST(cpu_adamw_scalars, ComputedOnceInDoubleAndRounded)
{
  const adamw_options o{.lr = 3e-4, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1};
  const adamw_scalars k = detail::make_adamw_scalars(o, 5);
  EXPECT_EQ(k.decay, static_cast<float>(1.0 - 3e-5));
  EXPECT_EQ(k.neg_step_size, static_cast<float>(-3e-4 / (1.0 - std::pow(0.8, 5))));
  EXPECT_EQ(k.inv_sqrt_bias2, static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.99, 5))));
  EXPECT_EQ(k.one_minus_beta2, static_cast<float>(1.0 - 0.99));
}

// The grouped stores are for a caller's layout: large arrays whose starts lie a round distance
// apart (packed back to back, or separately mapped, page-aligned). The runtime's own units start
// their large slabs staggered, where the plain loop is faster (docs/host.md#array-layout).
TEST(cpu_adamw_layout, StoresAreGroupedForLargeArraysThatAreNotStaggered)
{
  constexpr std::size_t n = (std::size_t{16} << 20) / sizeof(float);  // 16 MiB arrays
  constexpr std::size_t bytes = n * sizeof(float);
  const std::uintptr_t base = std::uintptr_t{1} << 40;  // addresses only: nothing is read or written
  const auto slabs = [&](std::array<std::uintptr_t, 4> at) {
    adamw_slabs s;
    // NOLINTBEGIN(cppcoreguidelines-pro-type-reinterpret-cast,performance-no-int-to-ptr)
    s.master = reinterpret_cast<float*>(at[0]);
    s.m = reinterpret_cast<float*>(at[1]);
    s.v = reinterpret_cast<float*>(at[2]);
    s.grad = reinterpret_cast<const void*>(at[3]);
    // NOLINTEND(cppcoreguidelines-pro-type-reinterpret-cast,performance-no-int-to-ptr)
    s.count = n;
    return s;
  };
  const adamw_slabs packed = slabs({base, base + bytes, base + 2 * bytes, base + 3 * bytes});
  EXPECT_FALSE(detail::staggered(packed));
  EXPECT_TRUE(detail::grouped_stores(packed));
  std::array<std::uintptr_t, 4> at{base, 0, 0, 0};
  for (std::size_t k = 1; k < at.size(); ++k) { at[k] = detail::stagger_offset(base, at[k - 1] + bytes, k); }
  const adamw_slabs staggered = slabs(at);
  EXPECT_TRUE(detail::staggered(staggered));
  EXPECT_FALSE(detail::grouped_stores(staggered));
  adamw_slabs small = packed;
  small.count = n / 4;  // 4 MiB: from the caches
  EXPECT_FALSE(detail::grouped_stores(small));
}

TEST(cpu_adamw_errors, RefusesMissingSlabsAndAnF32Copy)
{
  detail::host_task_arena arena(-1, 1);
  std::vector<float> a(8), b(8), c(8), g(8);
  adamw_slabs s{a.data(), b.data(), nullptr, g.data(), dtype::f32, nullptr, dtype::bf16, 8};
  EXPECT_THROW(detail::cpu_adamw_step(s, detail::make_adamw_scalars({}, 1), arena), invalid_argument);
  s.v = c.data();
  std::vector<float> copy(8);
  s.params = copy.data();
  s.param_type = dtype::f32;
  EXPECT_THROW(detail::cpu_adamw_step(s, detail::make_adamw_scalars({}, 1), arena), invalid_argument);
}

}  // namespace
}  // namespace taskswap::test
