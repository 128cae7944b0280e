// SPDX-License-Identifier: Apache-2.0
// Units registered never trained (unit_spec::trainable = false, a frozen base model): their
// parameters are all they cost, at home, on the device, in the plan check and in checkpoints;
// a trained use is refused before anything changes.

#include "expect_error.hpp"
#include "numeric/dtype_conversion.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

unit_spec base_unit(std::string name, std::size_t rows, dtype compute, residency r)
{
  unit_spec u;
  u.name = std::move(name);
  u.tensors = {{"weight", {rows, 64}}, {"bias", {rows}}};
  u.compute = compute;
  u.policy = unit_policy{r, 1, optimizer_placement::device};
  u.trainable = false;
  return u;
}

unit_spec adapter(std::string name)
{
  unit_spec u;
  u.name = std::move(name);
  u.tensors = {{"lora_A", {8, 64}}, {"lora_B", {64, 8}}};
  u.policy = unit_policy{residency::prefetch, 1, optimizer_placement::device};
  return u;
}

runtime_options budget(std::size_t bytes)
{
  runtime_options o;
  o.device.budget = bytes;
  return o;
}

// Random values in the unit's parameters at home (compute dtype), returned as written.
std::vector<std::byte> fill_home(runtime& rt, unit_id u, std::uint32_t seed)
{
  const home_view h = rt.home(u);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.0F, 1.0F);
  auto* p = static_cast<std::byte*>(h.params.data);
  for (std::size_t i = 0; i < h.params.count; ++i) { detail::narrow_element(p, h.params.type, i, d(gen)); }
  return {p, p + h.params.bytes()};
}

std::vector<std::byte> device_params(const device& dev, const unit_view& v, stream_view s)
{
  std::vector<std::byte> out(v.params.bytes());
  copy_async(std::span<std::byte>(out),
             const_device_span(&dev.backend(), static_cast<const std::byte*>(v.params.data), out.size()), s);
  s.synchronize();
  return out;
}

TEST(frozen_unit, costs_its_parameters_alone_at_home_on_the_device_and_in_the_footprint)
{
  for (const dtype compute : {dtype::f32, dtype::bf16}) {
    SCOPED_TRACE(to_string(compute));
    const unit_spec spec = base_unit("base", 256, compute, residency::prefetch);
    const std::size_t params = 256 * 65 * size_of(compute);  // 64-element aligned tensors: 256*64, then 256
    for (const optimizer_placement p : {optimizer_placement::device, optimizer_placement::host}) {
      const unit_footprint fp = footprint(spec, p);
      EXPECT_EQ(fp.param_bytes, params);
      EXPECT_EQ(fp.device_bytes, params);
      EXPECT_EQ(fp.home_bytes, params);
      EXPECT_EQ(fp.swap_in_bytes, params);
      EXPECT_EQ(fp.frozen_device_bytes, params);
      EXPECT_EQ(fp.write_back_bytes, 0U);
      EXPECT_EQ(fp.grad_bytes, 0U);
      EXPECT_EQ(fp.reduce_bytes, 0U);
    }
    unit_spec trained = spec;
    trained.trainable = true;
    const unit_footprint t = footprint(trained, optimizer_placement::device);
    // f32: params, m, v, grads; bf16: params, master, m, v, grads (each f32 but the params and grads)
    EXPECT_EQ(t.device_bytes, compute == dtype::f32 ? 4 * params : 2 * params + 3 * 2 * params) << "the unit trained";
  }
}

TEST(frozen_unit, is_used_frozen_only_and_a_trained_use_is_refused_before_anything_changes)
{
  const device dev = emulated_device({.memory_bytes = 4 * MiB});
  // bf16 base of 256 x 64: 33,280 B of parameters, 4x that to train. The budget holds the frozen
  // base pinned and the swapped one next to an adapter, and could not hold either trained.
  std::vector<unit_spec> units{base_unit("base/0", 256, dtype::bf16, residency::pinned),
                               base_unit("base/1", 256, dtype::bf16, residency::prefetch), adapter("task/0")};
  const std::size_t base_params = footprint(units[0], optimizer_placement::device).param_bytes;
  runtime_options o = budget(2 * base_params + footprint(units[2], optimizer_placement::device).device_bytes + 4 * KiB);
  runtime rt(dev, o, units);
  const unit_id b0{0};
  const unit_id b1{1};
  const unit_id a{2};
  const std::vector<std::byte> home0 = fill_home(rt, b0, 1);
  const std::vector<std::byte> home1 = fill_home(rt, b1, 2);
  const home_view h = rt.home(b0);
  EXPECT_EQ(h.master.count, 0U);
  EXPECT_EQ(h.m.count, 0U);
  EXPECT_EQ(h.v.count, 0U);

  expect_error_mentioning<config_error>([&] { rt.plan(step_plan{b0, a}); }, "never trained");
  const std::vector<step_plan> steps(
    3, step_plan{}.acquire(b0, unit_use::frozen).acquire(b1, unit_use::frozen).acquire(a));
  rt.plan(steps);
  stream s(dev);
  expect_error_mentioning<invalid_argument>([&] { (void)rt.acquire(b1, s); }, "never trained");
  EXPECT_EQ(rt.state(b1), unit_state::resident) << "the refused acquire left the prefetched unit as it was";
  std::size_t h2d = 0;
  for (int k = 0; k < 3; ++k) {
    const unit_view v0 = rt.acquire(b0, s, unit_use::frozen);
    const unit_view v1 = rt.acquire(b1, s, unit_use::frozen);
    const unit_view va = rt.acquire(a, s);
    EXPECT_EQ(device_params(dev, v0, s), home0);
    EXPECT_EQ(device_params(dev, v1, s), home1);
    EXPECT_EQ(v1.grads.count, 0U);
    std::vector<float> g(va.grads.count, 0.25F);
    copy_async(device_span(&dev.backend(), static_cast<std::byte*>(va.grads.data), g.size() * 4),
               std::as_bytes(std::span(g)), s);
    s.synchronize();  // `g` goes out of scope
    rt.step(a, s);
    for (const unit_id u : {a, b1, b0}) { rt.release(u, s); }
    const step_stats st = rt.end_step();
    EXPECT_EQ(st.write_backs, 0U);
    EXPECT_LE(st.peak_device_bytes, o.device.budget);
    h2d += st.h2d_bytes;
  }
  rt.flush();
  EXPECT_EQ(rt.home(a).step, 3);
  EXPECT_EQ(rt.home(b1).step, 0);
  EXPECT_EQ(std::memcmp(rt.home(b1).params.data, home1.data(), home1.size()), 0) << "never written back";
  const runtime_stats stats = rt.stats();
  EXPECT_EQ(stats.home_bytes, 2 * base_params + footprint(units[2], optimizer_placement::device).home_bytes);
  EXPECT_EQ(stats.total.d2h_bytes, 0U);
  EXPECT_LE(h2d, 3 * (base_params + footprint(units[2], optimizer_placement::device).swap_in_bytes));
}

TEST(frozen_unit, checkpoints_hold_its_parameters_and_a_unit_registered_otherwise_is_refused)
{
  const device dev = emulated_device({.memory_bytes = 4 * MiB});
  const std::filesystem::path dir =
    std::filesystem::temp_directory_path() / ("taskswap-frozen-unit-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<unit_spec> units{base_unit("base", 128, dtype::bf16, residency::pinned), adapter("task/0")};
  std::vector<std::byte> saved;
  {
    runtime rt(dev, budget(1 * MiB), units);
    saved = fill_home(rt, unit_id{0}, 7);
    rt.save_checkpoint(dir);
  }
  const checkpoint_manifest m = read_checkpoint_manifest(dir);
  ASSERT_EQ(m.units.size(), 2U);
  EXPECT_FALSE(m.units[0].trainable);
  EXPECT_FALSE(m.units[0].master.has_value());
  EXPECT_EQ(m.units[0].m.bytes, 0U);
  EXPECT_EQ(m.units[0].params.bytes, saved.size());
  EXPECT_TRUE(m.units[1].trainable);
  {
    runtime rt(dev, budget(1 * MiB), units);
    (void)rt.load_checkpoint(dir);
    EXPECT_EQ(std::memcmp(rt.home(unit_id{0}).params.data, saved.data(), saved.size()), 0);
  }
  units[0].trainable = true;
  runtime other(dev, budget(1 * MiB), units);
  const std::vector<std::byte> before = fill_home(other, unit_id{0}, 9);
  expect_error_mentioning<checkpoint_error>([&] { (void)other.load_checkpoint(dir); }, "never trained");
  EXPECT_EQ(std::memcmp(other.home(unit_id{0}).params.data, before.data(), before.size()), 0) << "nothing loaded";
  std::filesystem::remove_all(dir);
}

// A frozen unit of raw bytes (dtype::u8) stands for tensors of any element type: int8 weights
// of an odd size and a float scale, each given as [shape..., bytes per element].
TEST(frozen_unit, of_raw_bytes_moves_them_unread_at_their_alignments_and_is_refused_trained)
{
  unit_spec raw;
  raw.name = "quantized";
  raw.tensors = {{"qweight", {33, 17, 1}}, {"scale", {33, 4}}};
  raw.compute = dtype::u8;
  raw.policy = unit_policy{residency::on_demand, 0, optimizer_placement::device};
  raw.trainable = false;
  // 561 bytes, up to 576 (64-byte tensor alignment), 132 bytes of scale: 708, up to 768 (the slab's 256)
  EXPECT_EQ(footprint(raw, optimizer_placement::device).param_bytes, 768U);
  unit_spec trained = raw;
  trained.trainable = true;
  expect_error_mentioning<config_error>([&] { (void)footprint(trained, optimizer_placement::device); },
                                        "raw bytes (u8) are for a frozen unit");

  const device dev = emulated_device({.memory_bytes = 4 * MiB});
  const std::filesystem::path dir =
    std::filesystem::temp_directory_path() / ("taskswap-raw-unit-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<unit_spec> units{raw, base_unit("other", 64, dtype::f32, residency::on_demand)};
  std::vector<std::byte> written(561 + 132);
  std::mt19937 gen(11);
  for (std::byte& b : written) { b = static_cast<std::byte>(gen() & 0xFFU); }
  {
    runtime rt(dev, budget(17000), units);  // room for one of the two at a time
    const home_view h = rt.home(unit_id{0});
    ASSERT_EQ(h.params.type, dtype::u8);
    auto* home = static_cast<std::byte*>(h.params.data);
    std::memcpy(home, written.data(), 561);
    std::memcpy(home + 576, written.data() + 561, 132);
    stream s(dev);
    for (int k = 0; k < 2; ++k) {  // the second time both come back: neither stays (on demand)
      const unit_view v = rt.acquire(unit_id{0}, s, unit_use::frozen);
      const std::vector<std::byte> got = device_params(dev, v, s);
      EXPECT_EQ(std::memcmp(got.data(), written.data(), 561), 0);
      EXPECT_EQ(std::memcmp(got.data() + 576, written.data() + 561, 132), 0);
      EXPECT_EQ(v.tensors[1].offset, 576U) << "each tensor at a 64-byte boundary";
      const tensor_view scale = v.param_tensor(1);
      EXPECT_NE(scale.data<std::uint8_t>(), nullptr);
      expect_error_mentioning<invalid_argument>([&] { (void)scale.data<float>(); }, "std::uint8_t");
      rt.release(unit_id{0}, s);
      (void)rt.acquire(unit_id{1}, s, unit_use::frozen);
      rt.release(unit_id{1}, s);
      const step_stats st = rt.end_step();
      if (k == 1) { EXPECT_EQ(st.h2d_bytes, 768U + footprint(units[1], optimizer_placement::device).param_bytes); }
    }
    rt.save_checkpoint(dir);
  }
  EXPECT_EQ(read_checkpoint_manifest(dir).units[0].compute, dtype::u8);
  runtime rt(dev, budget(64 * KiB), units);
  (void)rt.load_checkpoint(dir);
  const auto* home = static_cast<const std::byte*>(rt.home(unit_id{0}).params.data);
  EXPECT_EQ(std::memcmp(home, written.data(), 561), 0);
  EXPECT_EQ(std::memcmp(home + 576, written.data() + 561, 132), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace taskswap::test
