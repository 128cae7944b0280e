// SPDX-License-Identifier: Apache-2.0
#pragma once

// The kernels on a backend's device against the CPU implementations, bit for bit: AdamW for every
// gradient dtype and parameter copy, unscale-and-check, casts, fill. Inputs are fresh random data
// with NaN, Inf and subnormal gradients mixed in; device outputs are poisoned before each launch;
// slabs start at element offsets 0..3 so the vector path, its head and its tail all run.

#include "host/cpu_adamw.hpp"
#include "kernels/kernels.hpp"
#include "test_scale.hpp"
#include "test_seed.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace taskswap::test {

// Device memory for `count` elements of `type`, starting `offset` elements into a buffer.
struct device_slab {
  device_slab(const device& dev, dtype t, std::size_t n, std::size_t offset_elements)
      : type(t), count(n), offset(offset_elements * size_of(t)), buffer(dev, (n + offset_elements) * size_of(t) + 16)
  {}
  [[nodiscard]] void* data() { return buffer.data() + offset; }
  [[nodiscard]] std::size_t bytes() const { return count * size_of(type); }
  template <typename T>
  void upload(const std::vector<T>& host, stream_view s)
  {
    copy_async(buffer.span(offset, bytes()), std::as_bytes(std::span(host)), s);
  }
  template <typename T>
  void download(std::vector<T>& host, stream_view s)
  {
    copy_async(std::as_writable_bytes(std::span(host)), buffer.span(offset, bytes()), s);
  }
  void poison(stream_view s) { taskswap::fill_async(buffer.span(), std::byte{0xFF}, s); }
  dtype type;
  std::size_t count;
  std::size_t offset;
  device_buffer buffer;
};

inline std::vector<std::uint16_t> to_16(const std::vector<float>& x, dtype t)
{
  std::vector<std::uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    out[i] = t == dtype::bf16 ? detail::float_to_bf16(x[i]) : detail::float_to_f16(x[i]);
  }
  return out;
}

inline std::vector<float> random_floats(std::size_t n, float scale, std::mt19937_64& gen, bool specials)
{
  std::normal_distribution<float> normal(0.0F, scale);
  std::vector<float> x(n);
  for (auto& e : x) { e = normal(gen); }
  if (specials) {
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> odd{
      std::numeric_limits<float>::quiet_NaN(), inf, -inf, 1e-41F, -3e-39F, 0.0F, -0.0F, 6e4F};
    for (std::size_t i = 0; i < odd.size() && i * 97 < n; ++i) { x[i * 97] = odd[i]; }
  }
  return x;
}

template <typename Backend>
class kernels_conformance : public ::testing::Test {
 protected:
  void SetUp() override
  {
    if (const std::string reason = Backend::skip_reason(); !reason.empty()) { GTEST_SKIP() << reason; }
    seed_ = test_seed();
    gen_.seed(seed_);
  }
  std::uint64_t seed_ = 0;
  std::mt19937_64 gen_;
};

TYPED_TEST_SUITE_P(kernels_conformance);

TYPED_TEST_P(kernels_conformance, AdamWIsBitwiseEqualToTheCpuPath)
{
  SCOPED_TRACE("seed " + std::to_string(this->seed_));
  const device dev = TypeParam::make();
  stream s(dev);
  detail::host_task_arena threads(-1, 0);
  const adamw_options options{.lr = 2e-3, .weight_decay = 0.05};
  std::vector<std::size_t> sizes{
    1, 3, 4, 5, 1023, 4099, large_case((std::size_t{1} << 20) + 5, (std::size_t{1} << 17) + 5)};
  if (TypeParam::large) { sizes.push_back((std::size_t{1} << 26) + 5); }
  for (const dtype grad_type : {dtype::f32, dtype::bf16, dtype::f16}) {
    for (const int copy : {0, 1, 2}) {
      const dtype param_type = copy == 2 ? dtype::f16 : dtype::bf16;
      for (const std::size_t n : sizes) {
        const std::size_t offset = (n + static_cast<std::size_t>(copy)) % 4;  // 0..3 elements
        SCOPED_TRACE(std::string(to_string(grad_type)) + " grads, copy " + std::to_string(copy) + ", n " +
                     std::to_string(n) + ", offset " + std::to_string(offset));
        std::vector<float> master = random_floats(n, 0.3F, this->gen_, false);
        std::vector<float> m = random_floats(n, 1e-3F, this->gen_, false);
        std::vector<float> v(n);
        for (auto& e : v) { e = std::abs(random_floats(1, 1e-3F, this->gen_, false)[0]); }
        device_slab d_master(dev, dtype::f32, n, offset), d_m(dev, dtype::f32, n, offset),
          d_v(dev, dtype::f32, n, offset);
        // Odd sizes put the gradients one element off the other slabs: their alignments then
        // disagree and every element takes the one-at-a-time path.
        device_slab d_grad(dev, grad_type, n, (offset + n % 2) % 4), d_params(dev, param_type, n, offset);
        d_master.upload(master, s);
        d_m.upload(m, s);
        d_v.upload(v, s);
        std::vector<std::uint16_t> params(copy != 0 ? n : 0);
        const int steps = n > (std::size_t{1} << 21) ? 1 : 3;
        for (std::int64_t step = 1; step <= steps; ++step) {
          auto k = detail::make_adamw_scalars(options, step);
          if (step == 3) {  // a guarded step's factors, by value
            k.grad_unscale = 1.0F / 4096.0F;
            k.grad_clip = 0.61F;
          }
          const std::vector<float> g32 = random_floats(n, step == 2 ? 5.0F : 1e-2F, this->gen_, true);
          const std::vector<std::uint16_t> g16 =
            grad_type == dtype::f32 ? std::vector<std::uint16_t>{} : to_16(g32, grad_type);
          if (grad_type == dtype::f32) {
            d_grad.upload(g32, s);
          } else {
            d_grad.upload(g16, s);
          }
          d_params.poison(s);
          detail::adamw_slabs on_device{static_cast<float*>(d_master.data()),
                                        static_cast<float*>(d_m.data()),
                                        static_cast<float*>(d_v.data()),
                                        d_grad.data(),
                                        grad_type,
                                        copy != 0 ? d_params.data() : nullptr,
                                        param_type,
                                        n};
          detail::adamw_async(on_device, k, s);
          s.synchronize();  // the uploads read the host vectors the reference now updates
          // The reference: the portable CPU path on the host copies.
          detail::adamw_slabs on_host{
            master.data(), m.data(),
            v.data(),      grad_type == dtype::f32 ? static_cast<const void*>(g32.data()) : g16.data(),
            grad_type,     copy != 0 ? params.data() : nullptr,
            param_type,    n};
          detail::cpu_adamw_range(on_host, k, 0, n, detail::cpu_isa::portable);
          std::vector<float> got_master(n), got_m(n), got_v(n);
          std::vector<std::uint16_t> got_params(params.size());
          d_master.download(got_master, s);
          d_m.download(got_m, s);
          d_v.download(got_v, s);
          if (copy != 0) { d_params.download(got_params, s); }
          s.synchronize();
          for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(std::bit_cast<std::uint32_t>(got_master[i]), std::bit_cast<std::uint32_t>(master[i]))
              << "master at " << i << ", step " << step << " (gradient " << g32[i] << ")";
            ASSERT_EQ(std::bit_cast<std::uint32_t>(got_m[i]), std::bit_cast<std::uint32_t>(m[i])) << "m at " << i;
            ASSERT_EQ(std::bit_cast<std::uint32_t>(got_v[i]), std::bit_cast<std::uint32_t>(v[i])) << "v at " << i;
          }
          ASSERT_EQ(got_params, params);
        }
      }
    }
  }
}

TYPED_TEST_P(kernels_conformance, UnscaleAndCheckMatchesTheCpuAndFlagsNonFinite)
{
  SCOPED_TRACE("seed " + std::to_string(this->seed_));
  const device dev = TypeParam::make();
  stream s(dev);
  for (const dtype type : {dtype::f32, dtype::bf16, dtype::f16}) {
    for (const bool with_inf : {false, true}) {
      SCOPED_TRACE(std::string(to_string(type)) + (with_inf ? " with inf" : " finite"));
      const std::size_t n = 300'001;
      std::vector<float> g = random_floats(n, 100.0F, this->gen_, false);
      if (with_inf) { g[n / 2] = std::numeric_limits<float>::infinity(); }
      device_slab d_grad(dev, type, n, 1);
      device_slab flag(dev, dtype::f32, 1, 0);
      std::vector<int> flag_host{0};
      flag.upload(flag_host, s);
      std::vector<std::uint16_t> g16 = type == dtype::f32 ? std::vector<std::uint16_t>{} : to_16(g, type);
      if (type == dtype::f32) {
        d_grad.upload(g, s);
      } else {
        d_grad.upload(g16, s);
      }
      detail::unscale_and_check_async(d_grad.data(), type, n, 1.0F / 1024.0F, static_cast<int*>(flag.data()), s);
      s.synchronize();  // the upload reads the host vector the reference now updates
      int host_flag = 0;
      void* reference = type == dtype::f32 ? static_cast<void*>(g.data()) : g16.data();
      detail::host_unscale_and_check(reference, type, n, 1.0F / 1024.0F, &host_flag);
      std::vector<float> got32(type == dtype::f32 ? n : 0);
      std::vector<std::uint16_t> got16(type == dtype::f32 ? 0 : n);
      if (type == dtype::f32) {
        d_grad.download(got32, s);
      } else {
        d_grad.download(got16, s);
      }
      flag.download(flag_host, s);
      s.synchronize();
      EXPECT_EQ(flag_host[0], with_inf ? 1 : 0);
      EXPECT_EQ(host_flag, with_inf ? 1 : 0);
      if (type == dtype::f32) {
        ASSERT_EQ(0, std::memcmp(got32.data(), g.data(), n * 4));
      } else {
        ASSERT_EQ(got16, g16);
      }
    }
  }
}

// A guarded step on the device against its CPU implementation, bit for bit: the square sums of
// two units' gradients at sizes around the lane count, the finish (norm, clipping, skip, next
// scale), each unit's scalars from its step count, and the AdamW that reads them; with an inf in
// the second unit nothing is updated, the step counts stay and the scale backs off.
TYPED_TEST_P(kernels_conformance, GuardedStepMatchesTheCpu)
{
  SCOPED_TRACE(std::string("seed ") + std::to_string(this->seed_));
  const device dev = TypeParam::make();
  stream s(dev);
  const adamw_options decay{.lr = 2e-3, .weight_decay = 0.05};
  adamw_options plain = decay;
  plain.weight_decay = 0;
  const detail::guard_settings settings{
    .clip = 0.8F, .scaler = true, .growth_factor = 2.0F, .backoff_factor = 0.5F, .growth_interval = 2};
  for (const dtype grad_type : {dtype::f32, dtype::f16}) {
    for (const bool with_inf : {false, true}) {
      SCOPED_TRACE(std::string(to_string(grad_type)) + (with_inf ? " with inf" : " finite"));
      const std::array<std::size_t, 2> sizes{detail::square_sum_lanes + 77, 1000};
      device_buffer state(dev, 4096);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the layout below
      auto* guard = reinterpret_cast<detail::step_guard*>(state.data());
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      auto* block_sums = reinterpret_cast<double*>(state.data() + 256);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      auto* scalars = reinterpret_cast<detail::adamw_scalars*>(state.data() + 2560);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      auto* steps = reinterpret_cast<std::int64_t*>(state.data() + 2816);
      detail::step_guard host_guard;
      host_guard.scale = 1024.0F;
      host_guard.growth_tracker = 1;
      std::vector<std::int64_t> host_steps{4};
      copy_async(state.span(0, sizeof host_guard), std::as_bytes(std::span(&host_guard, 1)), s);
      copy_async(state.span(2816, 8), std::as_bytes(std::span(host_steps)), s);
      struct unit {
        std::vector<float> master, m, v;
        std::vector<std::byte> grad;
      };
      std::vector<unit> units;
      std::vector<std::array<device_slab, 4>> slabs;
      for (std::size_t u = 0; u < 2; ++u) {
        const std::size_t n = sizes[u];
        unit h{random_floats(n, 0.3F, this->gen_, false), random_floats(n, 1e-3F, this->gen_, false),
               std::vector<float>(n), std::vector<std::byte>(n * size_of(grad_type))};
        for (auto& e : h.v) { e = std::abs(random_floats(1, 1e-3F, this->gen_, false)[0]); }
        std::vector<float> g = random_floats(n, 30.0F, this->gen_, false);
        if (with_inf && u == 1) { g[n / 2] = std::numeric_limits<float>::infinity(); }
        detail::host_cast(h.grad.data(), grad_type, g.data(), dtype::f32, n);
        slabs.push_back({device_slab(dev, dtype::f32, n, 0), device_slab(dev, dtype::f32, n, 0),
                         device_slab(dev, dtype::f32, n, 0), device_slab(dev, grad_type, n, 1)});
        slabs[u][0].upload(h.master, s);
        slabs[u][1].upload(h.m, s);
        slabs[u][2].upload(h.v, s);
        slabs[u][3].upload(h.grad, s);
        units.push_back(std::move(h));
      }
      for (std::size_t u = 0; u < 2; ++u) {
        detail::square_sum_async(slabs[u][3].data(), grad_type, sizes[u], guard, block_sums, s);
      }
      detail::finish_guard_async(guard, settings, s);
      for (std::size_t u = 0; u < 2; ++u) {  // both units share the step count slot: counted twice
        detail::prepare_guarded_async(decay, plain, steps, guard, scalars, s);
        const detail::adamw_slabs d{static_cast<float*>(slabs[u][0].data()),
                                    static_cast<float*>(slabs[u][1].data()),
                                    static_cast<float*>(slabs[u][2].data()),
                                    slabs[u][3].data(),
                                    grad_type,
                                    nullptr,
                                    dtype::bf16,
                                    sizes[u]};
        detail::adamw_async(d, scalars + u, guard, s);  // unit 1 without weight decay
      }
      s.synchronize();
      // The CPU: the same functions in the same order.
      for (std::size_t u = 0; u < 2; ++u) {
        detail::host_square_sum(units[u].grad.data(), grad_type, sizes[u], host_guard);
      }
      detail::finish_step_guard(host_guard, settings);
      for (std::size_t u = 0; u < 2; ++u) {
        detail::adamw_scalars k[2];
        detail::prepare_guarded_scalars(decay, plain, host_steps[0], host_guard, k);
        if (host_guard.skip != 0) { continue; }
        const detail::adamw_slabs h{units[u].master.data(),
                                    units[u].m.data(),
                                    units[u].v.data(),
                                    units[u].grad.data(),
                                    grad_type,
                                    nullptr,
                                    dtype::bf16,
                                    sizes[u]};
        detail::cpu_adamw_range(h, k[u], 0, sizes[u], detail::cpu_isa::portable);
      }
      detail::step_guard got_guard;
      std::vector<std::int64_t> got_steps(1);
      copy_async(std::as_writable_bytes(std::span(&got_guard, 1)), state.span(0, sizeof got_guard), s);
      copy_async(std::as_writable_bytes(std::span(got_steps)), state.span(2816, 8), s);
      s.synchronize();
      EXPECT_EQ(std::bit_cast<std::uint32_t>(got_guard.norm), std::bit_cast<std::uint32_t>(host_guard.norm));
      EXPECT_EQ(got_guard.clip_coef, host_guard.clip_coef);
      EXPECT_EQ(got_guard.skip, with_inf ? 1 : 0);
      EXPECT_EQ(got_guard.scale, with_inf ? 512.0F : 2048.0F);  // backed off, or grown (tracker 1 + 1 = interval)
      EXPECT_EQ(got_guard.scale, host_guard.scale);
      EXPECT_EQ(got_steps[0], with_inf ? 4 : 6);
      EXPECT_EQ(got_steps[0], host_steps[0]);
      if (!with_inf) { EXPECT_LT(got_guard.clip_coef, 1.0F) << "the gradients are large enough to clip"; }
      for (std::size_t u = 0; u < 2; ++u) {
        std::vector<float> master(sizes[u]);
        slabs[u][0].download(master, s);
        s.synchronize();
        ASSERT_EQ(0, std::memcmp(master.data(), units[u].master.data(), sizes[u] * 4)) << "unit " << u;
      }
    }
  }
}

TYPED_TEST_P(kernels_conformance, CastsAndFillMatchTheCpu)
{
  SCOPED_TRACE("seed " + std::to_string(this->seed_));
  const device dev = TypeParam::make();
  stream s(dev);
  const std::size_t n = 100'003;
  const std::vector<float> x = random_floats(n, 1e3F, this->gen_, true);
  for (const dtype from : {dtype::f32, dtype::bf16, dtype::f16}) {
    for (const dtype to : {dtype::f32, dtype::bf16, dtype::f16}) {
      SCOPED_TRACE(std::string(to_string(from)) + " -> " + std::string(to_string(to)));
      std::vector<std::byte> src(n * size_of(from));
      detail::host_cast(src.data(), from, x.data(), dtype::f32, n);
      std::vector<std::byte> want(n * size_of(to));
      detail::host_cast(want.data(), to, src.data(), from, n);
      device_slab d_src(dev, from, n, 3), d_dst(dev, to, n, 1);
      d_src.upload(src, s);
      d_dst.poison(s);
      detail::cast_async(d_dst.data(), to, d_src.data(), from, n, s);
      std::vector<std::byte> got(want.size());
      d_dst.download(got, s);
      s.synchronize();
      ASSERT_EQ(got, want);
    }
  }
  for (const dtype type : {dtype::f32, dtype::bf16, dtype::f16}) {
    for (const float value : {0.1F, -65520.0F, std::numeric_limits<float>::quiet_NaN()}) {
      std::vector<std::byte> want(n * size_of(type));
      detail::host_fill(want.data(), type, n, value);
      device_slab d(dev, type, n, 2);
      d.poison(s);
      detail::fill_async(d.data(), type, n, value, s);
      std::vector<std::byte> got(want.size());
      d.download(got, s);
      s.synchronize();
      ASSERT_EQ(got, want) << to_string(type) << " fill " << value;
    }
  }
}

TYPED_TEST_P(kernels_conformance, RefusesMisalignedAndInconsistentSlabs)
{
  const device dev = TypeParam::make();
  stream s(dev);
  device_buffer b(dev, 4096);
  auto* base = b.data();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): device memory viewed as floats
  auto* f = reinterpret_cast<float*>(base);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  detail::adamw_slabs misaligned{reinterpret_cast<float*>(base + 2), f, f, f, dtype::f32, nullptr, dtype::bf16, 8};
  EXPECT_THROW(detail::adamw_async(misaligned, detail::make_adamw_scalars({}, 1), s), invalid_argument);
  detail::adamw_slabs f32_copy{f, f + 16, f + 32, f + 48, dtype::f32, f + 64, dtype::f32, 8};
  EXPECT_THROW(detail::adamw_async(f32_copy, detail::make_adamw_scalars({}, 1), s), invalid_argument);
  EXPECT_THROW(detail::cast_async(base + 1, dtype::bf16, f, dtype::f32, 4, s), invalid_argument);
  EXPECT_THROW(detail::fill_async(nullptr, dtype::f32, 4, 1.0F, s), invalid_argument);
  s.synchronize();
}

REGISTER_TYPED_TEST_SUITE_P(kernels_conformance, AdamWIsBitwiseEqualToTheCpuPath,
                            UnscaleAndCheckMatchesTheCpuAndFlagsNonFinite, CastsAndFillMatchTheCpu,
                            GuardedStepMatchesTheCpu, RefusesMisalignedAndInconsistentSlabs);

}  // namespace taskswap::test
