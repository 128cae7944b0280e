// SPDX-License-Identifier: Apache-2.0
// Activation blocks (unit_spec::activation): a stash use writes the block on the device and its
// release sends it home; a frozen use brings it back as the plan says; the last read frees its
// room. The reference is the host copy of what was written; the budget counts the blocks.

#include "expect_error.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

unit_spec block(std::string name, std::size_t floats)
{
  unit_spec u;
  u.name = std::move(name);
  u.tensors = {{"x", {floats}}};
  u.activation = true;
  return u;
}

unit_spec weights(std::string name, std::size_t rows)
{
  unit_spec u;
  u.name = std::move(name);
  u.tensors = {{"weight", {rows, 64}}};
  u.policy = unit_policy{residency::prefetch, 1, optimizer_placement::device};
  u.trainable = false;
  return u;
}

std::vector<std::byte> random_bytes(std::size_t n, std::uint32_t seed)
{
  std::mt19937 gen(seed);
  std::vector<std::byte> out(n);
  for (std::byte& b : out) { b = static_cast<std::byte>(gen() & 0xFFU); }
  return out;
}

std::vector<std::byte> read_params(const device& dev, const unit_view& v, stream_view s)
{
  std::vector<std::byte> out(v.params.bytes());
  copy_async(std::span<std::byte>(out),
             const_device_span(&dev.backend(), static_cast<const std::byte*>(v.params.data), out.size()), s);
  s.synchronize();
  return out;
}

// A trunk of `layers` frozen weight units, each with an activation block of its own: the forward
// pass stashes block l after layer l, the backward pass reads them back last first. Random block
// sizes, budget, granule and lookahead; every read equals what was written, the budget holds with
// the blocks counted, each stash goes home once, and every block's room is free after its read.
void run_trunk(std::uint32_t seed)
{
  std::mt19937 gen(seed);
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(gen);
  };
  const std::size_t layers = pick(2, 9);
  const std::size_t granule = pick(0, 1) == 0 ? 256 : 64 * KiB;
  const device dev = emulated_device({.memory_bytes = 64 * MiB, .granularity = granule});
  std::vector<unit_spec> units;
  std::vector<std::size_t> floats(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    units.push_back(weights("layer/" + std::to_string(l), 64 * pick(1, 8)));
    floats[l] = 64 * pick(1, 2048);
    units.push_back(block("act/" + std::to_string(l), floats[l]));
  }
  std::size_t largest = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    const std::size_t pair = footprint(units[2 * l], optimizer_placement::device).device_bytes +
                             footprint(units[2 * l + 1], optimizer_placement::device).device_bytes;
    largest = std::max(largest, pair);
  }
  runtime_options o;
  o.defaults.lookahead = static_cast<int>(pick(0, 2));
  o.device.budget = (largest + 2 * granule) * pick(1, 3);  // a layer and its block, with room for rounding
  const auto layer = [](std::size_t l) { return unit_id{static_cast<std::uint32_t>(2 * l)}; };
  const auto act = [](std::size_t l) { return unit_id{static_cast<std::uint32_t>(2 * l + 1)}; };
  step_plan plan;
  for (std::size_t l = 0; l < layers; ++l) {
    plan.acquire(layer(l), unit_use::frozen).acquire(act(l), unit_use::stash).release(act(l)).release(layer(l));
  }
  for (std::size_t l = layers; l-- > 0;) {
    plan.acquire(layer(l), unit_use::frozen).acquire(act(l), unit_use::frozen).release(act(l)).release(layer(l));
  }
  SCOPED_TRACE("seed " + std::to_string(seed) + ": " + std::to_string(layers) + " layers, granule " +
               std::to_string(granule) + ", budget " + std::to_string(o.device.budget));
  runtime rt(dev, o, units);
  std::vector<std::vector<std::byte>> weight_home(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    const home_view h = rt.home(layer(l));
    weight_home[l] = random_bytes(h.params.bytes(), seed * 131 + static_cast<std::uint32_t>(l));
    std::memcpy(h.params.data, weight_home[l].data(), weight_home[l].size());
  }
  constexpr int steps = 3;
  rt.plan(std::vector<step_plan>(steps, plan));  // after the homes are written: a plan may prefetch
  stream s(dev);
  std::size_t stash_bytes = 0;  // each stash goes home once
  for (std::size_t l = 0; l < layers; ++l) {
    stash_bytes += footprint(units[2 * l + 1], optimizer_placement::device).param_bytes;
  }
  for (int k = 0; k < steps; ++k) {
    std::vector<std::vector<std::byte>> written(layers);
    for (std::size_t l = 0; l < layers; ++l) {
      const unit_view w = rt.acquire(layer(l), s, unit_use::frozen);
      const unit_view a = rt.acquire(act(l), s, unit_use::stash);
      ASSERT_EQ(a.params.count, floats[l]);
      EXPECT_EQ(read_params(dev, w, s), weight_home[l]);
      written[l] = random_bytes(a.params.bytes(),
                                seed * 7919 + static_cast<std::uint32_t>(k) * 100 + static_cast<std::uint32_t>(l));
      copy_async(device_span(&dev.backend(), static_cast<std::byte*>(a.params.data), written[l].size()),
                 std::span<const std::byte>(written[l]), s);
      rt.release(act(l), s);
      rt.release(layer(l), s);
    }
    for (std::size_t l = layers; l-- > 0;) {
      const unit_view w = rt.acquire(layer(l), s, unit_use::frozen);
      const unit_view a = rt.acquire(act(l), s, unit_use::frozen);
      EXPECT_EQ(read_params(dev, a, s), written[l]) << "act/" << l << ", step " << k;
      EXPECT_EQ(read_params(dev, w, s), weight_home[l]);
      rt.release(act(l), s);
      rt.release(layer(l), s);
      if (k + 1 == steps) { EXPECT_EQ(rt.state(act(l)), unit_state::home) << "its last read frees its room"; }
    }
    const step_stats st = rt.end_step();
    EXPECT_LE(st.peak_device_bytes, o.device.budget);
    EXPECT_EQ(st.d2h_bytes, stash_bytes) << "each stash goes home once, and nothing else";
    s.synchronize();  // `written` goes out of scope
  }
}

TEST(activation_block, stashes_and_reads_back_bitwise_in_random_trunks_within_the_budget)
{
  for (std::uint32_t seed = 1; seed <= 24; ++seed) { run_trunk(seed); }
}

TEST(activation_block, counts_in_the_plan_check_and_refuses_other_uses_before_anything_changes)
{
  const device dev = emulated_device({.memory_bytes = 4 * MiB});
  std::vector<unit_spec> units{weights("layer", 64), block("act/0", 16 * KiB), block("act/1", 16 * KiB)};
  runtime_options o;
  o.device.budget = footprint(units[0], optimizer_placement::device).device_bytes + 64 * KiB + 512;
  runtime rt(dev, o, units);
  const unit_id w{0};
  const unit_id a0{1};
  const unit_id a1{2};
  // A layer and one 64 KiB block fit; a second block held beside them does not.
  expect_error_mentioning<config_error>(
    [&] {
      rt.plan(step_plan{}.acquire(w, unit_use::frozen).acquire(a0, unit_use::stash).acquire(a1, unit_use::stash));
    },
    "'act/1'");
  expect_error_mentioning<config_error>([&] { rt.plan(step_plan{}.acquire(w, unit_use::stash)); },
                                        "not an activation block");
  expect_error_mentioning<config_error>([&] { rt.plan(step_plan{}.acquire(a0, unit_use::train)); },
                                        "an activation block");
  rt.plan(step_plan{}.acquire(a0, unit_use::stash).release(a0).acquire(a1, unit_use::stash).release(a1));
  stream s(dev);
  const unit_state before = rt.state(a0);  // its slot mapped ahead, or not
  expect_error_mentioning<invalid_argument>([&] { (void)rt.acquire(w, s, unit_use::stash); },
                                            "not an activation block");
  expect_error_mentioning<invalid_argument>([&] { (void)rt.acquire(a0, s); }, "activation block");
  EXPECT_EQ(rt.state(a0), before) << "the refused acquires changed nothing";
  (void)rt.acquire(a0, s, unit_use::stash);
  rt.release(a0, s);
  // Gone home; the budget holds one block, so the next stash's slot, mapped ahead, took its room.
  EXPECT_EQ(rt.state(a0), unit_state::home);
  EXPECT_EQ(rt.state(a1), unit_state::resident);
  (void)rt.acquire(a1, s, unit_use::stash);
  rt.release(a1, s);
  const step_stats st = rt.end_step();
  EXPECT_EQ(st.d2h_bytes, 2 * 64 * KiB);
  EXPECT_EQ(st.h2d_bytes, 0U) << "a stash copies nothing in";
  EXPECT_LE(st.peak_device_bytes, o.device.budget);

  unit_spec on_disk = block("act/disk", 64);
  on_disk.policy = unit_policy{};
  on_disk.policy->home = "disk";
  runtime_options d = o;
  d.storage.path = std::filesystem::temp_directory_path() / ("taskswap-act-" + std::to_string(::getpid()));
  d.storage.host_cache = 1 * MiB;
  expect_error_mentioning<config_error>([&] { runtime bad(dev, d, std::vector<unit_spec>{on_disk}); },
                                        "homed on the host");
  std::filesystem::remove_all(d.storage.path);
}

// A slot the prefetch mapped for a stash holds nothing: a read the plan did not foresee before the
// stash brings what the last stash sent home, not what another block left in that memory (a
// budget of one granule, shared memory as CUDA's physical pages: both take the same memory in turn).
TEST(activation_block, a_read_before_a_planned_stash_reads_the_home)
{
  const device dev = emulated_device({.memory_bytes = 4 * MiB, .granularity = 64 * KiB});
  std::vector<unit_spec> units{block("act/0", 12 * KiB), block("act/1", 12 * KiB)};  // 48 KiB: not packed
  runtime_options o;
  o.device.budget = 64 * KiB;
  runtime rt(dev, o, units);
  const unit_id a0{0};
  const unit_id a1{1};
  const auto stash_then_read = [](unit_id a) {
    return step_plan{}.acquire(a, unit_use::stash).release(a).acquire(a, unit_use::frozen).release(a);
  };
  rt.plan(std::vector<step_plan>{stash_then_read(a0), stash_then_read(a1), stash_then_read(a0)});
  stream s(dev);
  std::vector<std::vector<std::byte>> written;
  for (const unit_id a : {a0, a1}) {
    const unit_view w = rt.acquire(a, s, unit_use::stash);
    written.push_back(random_bytes(w.params.bytes(), 5 + a.value));
    copy_async(device_span(&dev.backend(), static_cast<std::byte*>(w.params.data), written.back().size()),
               std::span<const std::byte>(written.back()), s);
    rt.release(a, s);
    EXPECT_EQ(read_params(dev, rt.acquire(a, s, unit_use::frozen), s), written.back());
    rt.release(a, s);
    (void)rt.end_step();
  }
  ASSERT_EQ(rt.state(a0), unit_state::resident) << "the next stash's slot mapped ahead";
  EXPECT_EQ(read_params(dev, rt.acquire(a0, s, unit_use::frozen), s), written[0]) << "the home, not act/1's bytes";
  rt.release(a0, s);
  (void)rt.end_step();
}

TEST(activation_block, is_left_out_of_checkpoints)
{
  const device dev = emulated_device({.memory_bytes = 4 * MiB});
  const std::filesystem::path dir =
    std::filesystem::temp_directory_path() / ("taskswap-act-ck-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  unit_spec trained = weights("layer", 64);
  trained.trainable = true;
  runtime_options o;
  o.device.budget = 1 * MiB;
  {
    runtime rt(dev, o, std::vector<unit_spec>{trained, block("act/0", 1024)});
    rt.save_checkpoint(dir);
  }
  const checkpoint_manifest m = read_checkpoint_manifest(dir);
  ASSERT_EQ(m.units.size(), 1U);
  EXPECT_EQ(m.units[0].name, "layer");
  // Loads with any number of blocks, including none.
  for (const std::size_t blocks : {std::size_t{0}, std::size_t{3}}) {
    std::vector<unit_spec> units;
    for (std::size_t b = 0; b < blocks; ++b) { units.push_back(block("act/" + std::to_string(b), 256)); }
    units.push_back(trained);
    runtime rt(dev, o, units);
    EXPECT_EQ(rt.load_checkpoint(dir).units.size(), 1U);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace taskswap::test
