// SPDX-License-Identifier: Apache-2.0
// The public CPU AdamW (taskswap/cpu_adamw.hpp): bitwise the runtime's host step on the same
// operands, its checks, and the stagger rule that keeps the runtime's own layout off aliasing.

#include "expect_error.hpp"
#include "host/cpu_adamw.hpp"
#include "host/stream_stagger.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <span>
#include <string>
#include <sys/mman.h>
#include <random>
#include <vector>

namespace taskswap::test {
namespace {

struct operands {
  explicit operands(std::size_t n, dtype grad, bool copy, unsigned seed)
      : master(n), m(n), v(n), grad_bytes(n * size_of(grad)), params(copy ? n : 0), grad_type(grad)
  {
    std::mt19937 gen{seed};
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (float& x : master) { x = normal(gen); }
    for (std::size_t i = 0; i < n; ++i) {
      const float g = normal(gen) * 1e-2F;
      if (grad == dtype::f32) {
        std::memcpy(grad_bytes.data() + 4 * i, &g, 4);
      } else {
        const std::uint16_t h = detail::float_to_bf16(g);
        std::memcpy(grad_bytes.data() + 2 * i, &h, 2);
      }
    }
  }
  adamw_tensors tensors()
  {
    return {master, m, v, grad_bytes.data(), grad_type, params.empty() ? nullptr : params.data(), dtype::bf16};
  }
  detail::adamw_slabs slabs()
  {
    return {master.data(),     m.data(),     v.data(),
            grad_bytes.data(), grad_type,    params.empty() ? nullptr : params.data(),
            dtype::bf16,       master.size()};
  }
  std::vector<float> master, m, v;
  std::vector<std::byte> grad_bytes;
  std::vector<std::uint16_t> params;
  dtype grad_type;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b)
{
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(cpu_adamw_public, BitwiseTheRuntimesHostStepAtAnyThreadCount)
{
  const adamw_options hyper{.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-7, .weight_decay = 0.05};
  for (const bool bf16 : {false, true}) {
    for (const int threads : {1, 2}) {
      const std::size_t n = (std::size_t{1} << 18) + 13;
      operands pub(n, bf16 ? dtype::bf16 : dtype::f32, bf16, 7);
      operands ref(n, bf16 ? dtype::bf16 : dtype::f32, bf16, 7);
      cpu_adamw opt({.threads = threads});
      EXPECT_EQ(opt.threads(), threads);
      EXPECT_FALSE(opt.instruction_set().empty());
      detail::host_task_arena arena(-1, 1);
      for (std::int64_t step = 1; step <= 3; ++step) {
        opt.step(pub.tensors(), hyper, step);
        detail::cpu_adamw_step(ref.slabs(), detail::make_adamw_scalars(hyper, step), arena);
      }
      EXPECT_TRUE(same_bits(pub.master, ref.master));
      EXPECT_TRUE(same_bits(pub.m, ref.m));
      EXPECT_TRUE(same_bits(pub.v, ref.v));
      EXPECT_EQ(pub.params, ref.params);
      EXPECT_FALSE(same_bits(pub.master, operands(n, dtype::f32, false, 7).master));  // it moved
    }
  }
}

TEST(cpu_adamw_public, RefusesWhatTheConfigLoaderRefusesAndBadOperands)
{
  operands o(64, dtype::f32, false, 1);
  // The state before any refused call: each refusal must leave it as it was.
  const std::vector<float> master = o.master;
  const std::vector<float> m = o.m;
  const std::vector<float> v = o.v;
  cpu_adamw opt({.threads = 1});
  const auto with = [](auto change) {
    adamw_options h;
    change(h);
    return h;
  };
  expect_error_mentioning<config_error>([&] { opt.step(o.tensors(), with([](adamw_options& h) { h.lr = 0; }), 1); },
                                        "lr is 0: must be a positive number");
  expect_error_mentioning<config_error>([&] { opt.step(o.tensors(), with([](adamw_options& h) { h.eps = -1; }), 1); },
                                        "eps is -1: must be a positive number");
  expect_error_mentioning<config_error>(
    [&] { opt.step(o.tensors(), with([](adamw_options& h) { h.beta2 = 1.0; }), 1); },
    "betas are (0.9, 1): each beta must be in [0, 1)");
  expect_error_mentioning<config_error>(
    [&] { opt.step(o.tensors(), with([](adamw_options& h) { h.weight_decay = -0.1; }), 1); },
    "weight_decay is -0.1: must be 0 or more");
  EXPECT_EQ(adamw_options_problem({}), "");
  EXPECT_EQ(adamw_options_problem(with([](adamw_options& h) { h.lr = std::nan(""); })),
            "lr is nan: must be a positive number");

  expect_error_mentioning<invalid_argument>([&] { opt.step(o.tensors(), {}, 0); },
                                            "first update of a tensor is step 1");
  adamw_tensors t = o.tensors();
  t.m = t.m.first(10);
  expect_error_mentioning<invalid_argument>([&] { opt.step(t, {}, 1); }, "give each as many");
  t = o.tensors();
  t.grad = nullptr;
  expect_error_mentioning<invalid_argument>([&] { opt.step(t, {}, 1); }, "no gradients");
  t = o.tensors();
  t.grad = o.v.data() + 3;  // the gradients overlap v
  expect_error_mentioning<invalid_argument>([&] { opt.step(t, {}, 1); }, "v and grad overlap");
  t = o.tensors();
  t.params = o.params.data();
  std::vector<float> f32_copy(64);
  t.params = f32_copy.data();
  t.param_type = dtype::f32;
  expect_error_mentioning<invalid_argument>([&] { opt.step(t, {}, 1); }, "pass params = nullptr");
  expect_error_mentioning<invalid_argument>([] { cpu_adamw bad({.threads = -1}); }, "threads is -1");
  expect_error_mentioning<invalid_argument>([] { cpu_adamw bad({.numa_node = -2}); }, "numa_node is -2");
  EXPECT_TRUE(same_bits(o.master, master));  // nothing refused touched the state
  EXPECT_TRUE(same_bits(o.m, m));
  EXPECT_TRUE(same_bits(o.v, v));
  opt.step({}, {}, 1);  // nothing to do is fine
  EXPECT_TRUE(same_bits(o.master, master));
  opt.step(o.tensors(), {}, 1);  // and the operands the refused calls were given do step
  EXPECT_FALSE(same_bits(o.master, master));
}

// Arrays cut from one block a multiple of 128 MiB apart run at a fraction of the speed on some
// CPUs: the step still runs (bitwise the same) and says so once.
TEST(cpu_adamw_public, WarnsOnceAboutArraysARoundDistanceApart)
{
  constexpr std::size_t n = std::size_t{2} << 20;  // 8 MiB per f32 array: large enough to matter
  constexpr std::size_t apart = std::size_t{128} << 20;
  void* block =
    mmap(nullptr, 3 * apart + n * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(block, MAP_FAILED);
  auto* base = static_cast<std::byte*>(block);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  const auto floats = [&](std::size_t k) { return std::span<float>(reinterpret_cast<float*>(base + k * apart), n); };
  std::vector<float> g(n, 1e-3F);
  std::vector<std::string> warnings;
  const log_handler previous = set_log_handler([&](log_level level, std::string_view text) {
    if (level == log_level::warning) { warnings.emplace_back(text); }
  });
  cpu_adamw opt({.threads = 1});
  for (int i = 0; i < 2; ++i) { opt.step({floats(0), floats(1), floats(2), g.data(), dtype::f32}, {}, 1); }
  set_log_handler(previous);
  munmap(block, 3 * apart + n * 4);
  ASSERT_EQ(warnings.size(), 1U);
  EXPECT_NE(warnings[0].find("master and m start 128.0 MiB"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("docs/host.md"), std::string::npos) << warnings[0];
}

TEST(stream_stagger, ScoresRoundDistancesLowAndSpreadsUpToFiveStreams)
{
  using detail::stagger_score;
  EXPECT_EQ(stagger_score(std::size_t{256} << 20), 0.0);
  EXPECT_LT(stagger_score((std::size_t{256} << 20) + 64), 1.0);  // 64 B off a 64 KiB multiple
  EXPECT_LT(stagger_score((std::size_t{128} << 20) + 4352), 1.0);  // 4.25 KiB: measured slow
  EXPECT_LT(stagger_score((std::size_t{128} << 20) + (16 << 10)), 1.0);  // a multiple of 4 KiB
  EXPECT_GE(stagger_score((std::size_t{256} << 20) + (12 << 10) + 1024), 1.0);
  // Five arrays of sizes round and not, back to back, each placed after the ones before: every
  // pair clean, each moved less than the window, the slab alignment kept.
  std::mt19937_64 rng(7);
  std::vector<std::size_t> sizes{std::size_t{8} << 20, std::size_t{64} << 20, std::size_t{256} << 20,
                                 std::size_t{3} << 28};
  for (int i = 0; i < 200; ++i) { sizes.push_back((rng() % (std::size_t{1} << 30)) / 256 * 256 + 256); }
  for (const std::size_t size : sizes) {
    std::vector<std::size_t> starts{0};
    std::size_t at = size;
    for (std::size_t k = 1; k < detail::stagger_max_streams; ++k) {
      const std::size_t placed = detail::stagger_offset(0, at, k);
      EXPECT_EQ(placed % 256, 0U);
      EXPECT_LT(placed - at, detail::stagger_window);
      for (const std::size_t e : starts) { EXPECT_GE(stagger_score(placed - e), 1.0) << size << " stream " << k; }
      starts.push_back(placed);
      at = placed + size;
    }
  }
}

}  // namespace
}  // namespace taskswap::test
