// SPDX-License-Identifier: Apache-2.0
// Guarded steps (loss scaling, clipping) on the emulated backend: swapped equals all-resident,
// checkpoints carry the scaler and the step counts, the plan check counts trained units to the
// step's end, the kernels' square sum order, and the errors. (Against torch: guarded_vs_torch.py.)

#include "expect_error.hpp"
#include "kernels/kernels.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = 1024;

unit_spec make_unit(std::string name, std::size_t elements, dtype compute = dtype::f32)
{
  unit_spec u;
  u.name = std::move(name);
  u.tensors = {{"w", {elements}}, {"b", {7}, true}};
  u.compute = compute;
  return u;
}

runtime_options guarded_options(std::size_t budget, residency r, dtype compute)
{
  runtime_options o;
  o.device.backend = backend_kind::emulated;
  o.device.budget = budget;
  o.defaults.residency = r;
  o.defaults.lookahead = 1;
  o.optimizer.lr = 1e-2;
  o.optimizer.clip = 0.5;
  o.scaler.enabled = true;
  o.scaler.init_scale = compute == dtype::f16 ? 1024.0 : 65536.0;
  o.scaler.growth_interval = 4;
  return o;
}

// Five tasks and a trunk; step k trains the trunk and tasks k % 5 and (k * 3) % 5 (the same one
// twice gives one); the gradients are scaled by the device's loss scale and, at `inf_steps`, one
// is infinite. Returns every unit's master and the scaler's state after `steps` steps, from
// `first`, saving a checkpoint after `save_at` steps (and stopping there) if asked.
struct run_result {
  std::vector<std::vector<float>> masters;
  std::vector<std::int64_t> steps;
  loss_scaler_state scaler;
  std::size_t evictions = 0;
};

run_result train(const runtime_options& o, dtype compute, int first, int last, const std::vector<int>& inf_steps,
                 const std::filesystem::path& load = {}, const std::filesystem::path& save = {})
{
  const device dev = make_device(o.device);
  std::vector<unit_spec> units{make_unit("trunk", 300, compute)};
  for (int t = 0; t < 5; ++t) {
    units.push_back(
      make_unit(std::string("task/") + std::to_string(t), 200 + 37 * static_cast<std::size_t>(t), compute));
  }
  runtime rt(dev, o, units);
  if (!load.empty()) {
    (void)rt.load_checkpoint(load);
  } else {
    for (std::uint32_t u = 0; u < rt.unit_count(); ++u) {
      const home_view h = rt.home(unit_id{u});
      for (std::size_t i = 0; i < h.master.count; ++i) {
        static_cast<float*>(h.master.data)[i] = std::sin(static_cast<float>(i * 7 + u)) * 0.1F;
      }
    }
  }
  stream s(dev);
  const float* scale = rt.loss_scale();
  for (int k = first; k < last; ++k) {
    std::vector<unit_id> ids{unit_id{0}, unit_id{static_cast<std::uint32_t>(1 + k % 5)}};
    if (const unit_id other{static_cast<std::uint32_t>(1 + (k * 3) % 5)}; other.value != ids[1].value) {
      ids.push_back(other);
    }
    rt.plan(step_plan(std::span<const unit_id>(ids)));
    const bool inf = std::find(inf_steps.begin(), inf_steps.end(), k) != inf_steps.end();
    for (const unit_id u : ids) {
      const unit_view v = rt.acquire(u, s);
      const slab_view g = v.grads;
      launch_host_func(s, [g, u, k, scale, inf] {
        for (std::size_t i = 0; i < g.count; ++i) {
          const float x =
            std::cos(static_cast<float>(i * 3 + u.value * 11 + static_cast<std::size_t>(k))) * 2.0F * *scale;
          if (g.type == dtype::f32) {
            static_cast<float*>(g.data)[i] = x;
          } else {
            static_cast<std::uint16_t*>(g.data)[i] = detail::float_to_f16(x);
          }
        }
        if (inf && u.value != 0) {
          if (g.type == dtype::f32) {
            static_cast<float*>(g.data)[5] = std::numeric_limits<float>::infinity();
          } else {
            static_cast<std::uint16_t*>(g.data)[5] = 0x7C00U;
          }
        }
      });
      rt.grads_ready(u, s);
      rt.step(u, s);
      rt.release(u, s);
    }
    (void)rt.end_step();
  }
  if (!save.empty()) { rt.save_checkpoint(save); }
  rt.flush();
  run_result r;
  for (std::uint32_t u = 0; u < rt.unit_count(); ++u) {
    const home_view h = rt.home(unit_id{u});
    const float* m = static_cast<const float*>(h.master.data);
    r.masters.emplace_back(m, m + h.master.count);
    r.steps.push_back(h.step);
  }
  r.scaler = rt.scaler_state();
  r.evictions = rt.stats().total.evictions;
  return r;
}

class guarded_step : public ::testing::TestWithParam<dtype> {};

// Units swapped through a tight budget and all resident give the same bits: the updates wait for
// the step's end, whatever the residency, and the step counts skip alike.
TEST_P(guarded_step, swapped_equals_all_resident_and_skipped_steps_do_not_count)
{
  const dtype compute = GetParam();
  const std::vector<int> infs{3, 4, 9};
  const run_result resident = train(guarded_options(512 * KiB, residency::pinned, compute), compute, 0, 14, infs);
  const run_result swapped = train(guarded_options(26 * KiB, residency::prefetch, compute), compute, 0, 14, infs);
  EXPECT_EQ(resident.evictions, 0U);
  EXPECT_GT(swapped.evictions, 10U);
  EXPECT_EQ(resident.masters, swapped.masters);
  EXPECT_EQ(resident.steps, swapped.steps);
  EXPECT_EQ(resident.scaler.scale, swapped.scaler.scale);
  EXPECT_EQ(resident.scaler.skipped_steps, 3);
  EXPECT_EQ(resident.scaler.steps, 14);
  // The trunk trains every step: 14 steps, 3 skipped.
  EXPECT_EQ(resident.steps[0], 11);
  for (const auto& m : resident.masters) {
    for (const float x : m) { ASSERT_TRUE(std::isfinite(x)); }
  }
  // Scale: 3 skips back off; growth after 4 finite steps in a row (steps 5-8, 10-13).
  const float init = compute == dtype::f16 ? 1024.0F : 65536.0F;
  EXPECT_EQ(resident.scaler.scale, init / 8.0F * 4.0F);
  EXPECT_EQ(resident.scaler.growth_tracker, 0);
}

// A checkpoint carries the scale, its tracker and the step counts: a resumed run equals one that
// never stopped, bit for bit.
TEST_P(guarded_step, a_checkpoint_resumes_the_scaler_and_the_step_counts)
{
  const dtype compute = GetParam();
  const std::vector<int> infs{2, 7};
  const runtime_options o = guarded_options(48 * KiB, residency::prefetch, compute);
  const run_result whole = train(o, compute, 0, 12, infs);
  const std::filesystem::path dir =
    std::filesystem::path(::testing::TempDir()) / (std::string("guarded-ck-") + std::string(to_string(compute)));
  std::filesystem::remove_all(dir);
  (void)train(o, compute, 0, 6, infs, {}, dir);
  const checkpoint_manifest m = read_checkpoint_manifest(dir);
  ASSERT_TRUE(m.scaler.has_value());
  EXPECT_EQ(m.optimizer.clip, 0.5);
  const run_result resumed = train(o, compute, 6, 12, infs, dir);
  EXPECT_EQ(whole.masters, resumed.masters);
  EXPECT_EQ(whole.steps, resumed.steps);
  EXPECT_EQ(whole.scaler.scale, resumed.scaler.scale);
  EXPECT_EQ(whole.scaler.growth_tracker, resumed.scaler.growth_tracker);
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(dtypes, guarded_step, ::testing::Values(dtype::f32, dtype::f16),
                         [](const auto& p) { return std::string(to_string(p.param)); });

// In a guarded step a trained unit keeps its room until the step's end: a plan that releases one
// to make room for the next fits unguarded and is refused guarded, with the reason.
TEST(guarded_step_plan, trained_units_count_until_the_step_ends)
{
  runtime_options o;
  o.device.backend = backend_kind::emulated;
  o.defaults.residency = residency::on_demand;
  const auto plan_two = [&](runtime_options opts, std::size_t budget) {
    opts.device.budget = budget;
    const device dev = make_device(opts.device);
    runtime rt(dev, opts, {make_unit("a", 2000), make_unit("b", 2000)});
    const std::size_t one = rt.device_bytes(unit_id{0});
    (void)one;
    rt.plan(step_plan().acquire(unit_id{0}).release(unit_id{0}).acquire(unit_id{1}));
  };
  const std::size_t budget = footprint(make_unit("a", 2000), optimizer_placement::device).device_bytes + 8 * KiB;
  EXPECT_NO_THROW(plan_two(o, budget));
  runtime_options g = o;
  g.optimizer.clip = 1.0;
  expect_error_mentioning<config_error>([&] { plan_two(g, budget); },
                                        "trained units released within a step count until it ends");
  EXPECT_NO_THROW(plan_two(g, 2 * budget + 8 * KiB));
}

TEST(guarded_step_errors, say_what_to_change)
{
  runtime_options o;
  o.device.backend = backend_kind::emulated;
  o.device.budget = 64 * KiB;
  const device dev = make_device(o.device);
  runtime plain(dev, o, {make_unit("a", 100)});
  EXPECT_FALSE(plain.guards_steps());
  expect_error_mentioning<invalid_argument>([&] { (void)plain.loss_scale(); }, "[scaler] enabled = true");
  expect_error_mentioning<invalid_argument>([&] { (void)plain.scaler_state(); }, "steps are not guarded");
  adamw_options clipped = plain.optimizer();
  clipped.clip = 1.0;
  expect_error_mentioning<config_error>([&] { plain.set_optimizer(clipped); }, "made without clipping");
  clipped.clip = -1.0;
  expect_error_mentioning<config_error>([&] { plain.set_optimizer(clipped); }, "clip");

  runtime_options bad = o;
  bad.scaler.enabled = true;
  bad.scaler.backoff_factor = 1.5;
  expect_error_mentioning<config_error>([&] { runtime r(dev, bad, {make_unit("a", 100)}); }, "backoff_factor");
  bad = o;
  bad.scaler.enabled = true;
  bad.device.budget = 1 * KiB;
  expect_error_mentioning<config_error>([&] { runtime r(dev, bad, {make_unit("a", 100)}); },
                                        "loss scaling and clipping take");

  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 MiB\"\n[scaler]\ngrowth_factor = 0.5\n", "t"); }, "growth_factor");
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 MiB\"\n[scaler]\nscale = 2.0\n", "t"); }, "has no key 'scale'");
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 MiB\"\n[optimizer]\nclip = -1.0\n", "t"); }, "clip");
  const runtime_options p =
    parse_config("[device]\nbudget = \"1 MiB\"\n[optimizer]\nclip = 1.0\n[scaler]\nenabled = true\ninit_scale = 128.0\n"
                 "growth_factor = 4.0\nbackoff_factor = 0.25\ngrowth_interval = 10\n",
                 "t");
  EXPECT_EQ(p.optimizer.clip, 1.0);
  EXPECT_TRUE(p.scaler.enabled);
  EXPECT_EQ(p.scaler.init_scale, 128.0);
  EXPECT_EQ(p.scaler.growth_factor, 4.0);
  EXPECT_EQ(p.scaler.backoff_factor, 0.25);
  EXPECT_EQ(p.scaler.growth_interval, 10);
}

// The CPU square sum follows the CUDA kernel's order (lanes, then two trees) and agrees with a
// double-precision reference; an inf or NaN anywhere makes it non-finite.
TEST(square_sum, matches_a_double_reference_at_sizes_around_the_lane_count)
{
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  for (const std::size_t n : {std::size_t{1}, std::size_t{255}, detail::square_sum_lanes - 1,
                              detail::square_sum_lanes + 3, 3 * detail::square_sum_lanes + 17}) {
    std::vector<float> g(n);
    for (float& x : g) { x = normal(rng) * 1024.0F; }
    detail::step_guard guard;
    guard.scale = 1024.0F;
    detail::host_square_sum(g.data(), dtype::f32, n, guard);
    long double ref = 0;
    for (const float x : g) { ref += static_cast<long double>(x / 1024.0F) * (x / 1024.0F); }
    EXPECT_NEAR(guard.square_sum, static_cast<double>(ref), 1e-12 * static_cast<double>(ref)) << n;
    detail::guard_settings k{
      .clip = 1.0F, .scaler = true, .growth_factor = 2.0F, .backoff_factor = 0.5F, .growth_interval = 2};
    detail::step_guard finished = guard;
    detail::finish_step_guard(finished, k);
    EXPECT_EQ(finished.skip, 0);
    EXPECT_FLOAT_EQ(finished.norm, static_cast<float>(std::sqrt(static_cast<double>(ref))));
    EXPECT_EQ(finished.square_sum, 0.0);
    g[n / 2] = std::numeric_limits<float>::quiet_NaN();
    detail::step_guard bad;
    bad.scale = 1024.0F;
    detail::host_square_sum(g.data(), dtype::f32, n, bad);
    detail::finish_step_guard(bad, k);
    EXPECT_EQ(bad.skip, 1);
    EXPECT_EQ(bad.scale, 512.0F);
    EXPECT_EQ(bad.skipped_steps, 1);
  }
}

}  // namespace
}  // namespace taskswap::test
