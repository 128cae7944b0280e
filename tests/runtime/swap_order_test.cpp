// SPDX-License-Identifier: Apache-2.0
// Swap-ins whose copies wait for their slots' mappings (Note [Swap-ins waiting for a mapping],
// runtime/swap/swap_engine.cpp): a swap-in decided later, whose room is a unit the trainer's
// stream still uses, holds up none of them.

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t elements = 16 * KiB;  // 64 KiB of f32 parameters: one granule

float initial(std::size_t k, std::size_t i) { return static_cast<float>(k + 1) + static_cast<float>(i % 100) * 1e-2F; }

// The elements of unit k's parameters, as its view shows them now, that differ from its home's.
std::size_t differing(const unit_view& u, std::size_t k)
{
  const auto* p = static_cast<const float*>(u.params.data);
  std::size_t n = 0;
  for (std::size_t i = 0; i < elements; ++i) { n += p[i] != initial(k, i) ? 1U : 0U; }
  return n;
}

// A frozen trunk of six one-granule units in room for three, on an emulated device whose maps take
// 50 ms each (the mapping thread runs well behind the trainer). The first use's compute blocks its
// stream; its release then decides the fourth unit's swap-in into its room, which must wait for
// that release. The second unit's swap-in was decided earlier (at the first acquire) and its copy
// is queued once its map is done, after that decision: used on another stream, it arrives while
// the first stream is still blocked, with its home's bytes. Queued on h2d behind the fourth
// unit's wait, it would arrive only after the first stream's compute; the fourth unit's copy
// without that wait would overwrite the first unit while its compute reads it.
TEST(swap_order, a_copy_waiting_for_its_mapping_is_not_held_up_by_a_later_swap_ins_wait)
{
  emulated_options eo{.memory_bytes = std::size_t{16} << 20, .granularity = 64 * KiB};
  eo.vm_costs.map = {.per_call_seconds = 0.05, .per_mib_seconds = 0.0};
  const device dev = emulated_device(eo);
  std::vector<unit_spec> specs(6);
  for (std::size_t k = 0; k < specs.size(); ++k) {
    specs[k].name = "layer/" + std::to_string(k);
    specs[k].tensors = {{"w", {elements}}};
    specs[k].trainable = false;
    specs[k].policy = unit_policy{residency::prefetch, 1, optimizer_placement::device};
  }
  runtime_options o;
  o.device.budget = 3 * 64 * KiB;
  runtime rt(dev, o, specs);
  for (std::uint32_t k = 0; k < specs.size(); ++k) {
    auto* p = static_cast<float*>(rt.home(unit_id{k}).params.data);
    for (std::size_t i = 0; i < elements; ++i) { p[i] = initial(k, i); }
  }
  step_plan step;
  for (std::uint32_t k = 0; k < specs.size(); ++k) { step.acquire(unit_id{k}, unit_use::frozen).release(unit_id{k}); }
  rt.plan(step);
  stream first(dev);
  stream other(dev);
  std::atomic<bool> open{false};
  std::atomic<std::size_t> overwritten{0};  // of the first unit while its compute read it
  const unit_view u0 = rt.acquire(unit_id{0}, first, unit_use::frozen);
  launch_host_func(first, [&, u0] {
    while (!open.load()) { std::this_thread::sleep_for(std::chrono::milliseconds{1}); }
    overwritten += differing(u0, 0);
  });
  rt.release(unit_id{0}, first);  // the fourth unit's swap-in takes its room, after this release
  const unit_view v = rt.acquire(unit_id{1}, other, unit_use::frozen);
  std::atomic<bool> arrived{false};
  std::atomic<std::size_t> wrong{0};
  launch_host_func(other, [&, v] {
    wrong += differing(v, 1);
    arrived = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{10};
  while (!arrived.load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  const bool before_release = arrived.load();
  // The fourth unit's map is done by now (four maps of 50 ms): the release queues its copy, which
  // must wait for the first unit's release.
  std::this_thread::sleep_for(std::chrono::milliseconds{300});
  rt.release(unit_id{1}, other);
  std::this_thread::sleep_for(std::chrono::milliseconds{50});
  open = true;
  EXPECT_TRUE(before_release) << "the second unit arrived only after the first stream's compute";
  other.synchronize();
  EXPECT_EQ(wrong.load(), 0U) << "elements of the second unit that differ from its home";
  for (std::uint32_t k = 2; k < specs.size(); ++k) {
    const unit_view u = rt.acquire(unit_id{k}, first, unit_use::frozen);
    launch_host_func(first, [&, u, k] { wrong += differing(u, k); });
    rt.release(unit_id{k}, first);
  }
  (void)rt.end_step();
  rt.flush();
  first.synchronize();
  EXPECT_EQ(wrong.load(), 0U) << "elements of the later units that differ from their homes";
  EXPECT_EQ(overwritten.load(), 0U) << "elements of the first unit overwritten while its compute ran";
  EXPECT_EQ(rt.stats().total.swap_ins, 6U);
}

}  // namespace
}  // namespace taskswap::test
