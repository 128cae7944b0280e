// SPDX-License-Identifier: Apache-2.0
// Swap-ins whose copies wait for their slots' mappings (Note [Swap-ins waiting for a mapping],
// runtime/swap/swap_engine.cpp): a swap-in decided later, whose room is a unit the trainer's
// stream still uses, holds up none of them; and a write into pool memory after every pending
// wait (a gradient slab for a host update) still follows the waits they took off h2d.

#include "runtime/adamw_reference.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t elements = 16 * KiB;  // 64 KiB of f32 parameters: one granule

float initial(std::size_t k, std::size_t i) { return static_cast<float>(k + 1) + static_cast<float>(i % 100) * 1e-2F; }

// The elements of unit k's parameter slab `s` that differ from initial().
std::size_t differing(const slab_view& s, std::size_t k)
{
  const auto* p = static_cast<const float*>(s.data);
  std::size_t n = 0;
  for (std::size_t i = 0; i < s.count; ++i) { n += p[i] != initial(k, i) ? 1U : 0U; }
  return n;
}

// The elements of unit k's parameters, as its view shows them now, that differ from its home's.
std::size_t differing(const unit_view& u, std::size_t k) { return differing(u.params, k); }

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

// ---- a write into pool memory after every pending wait -----------------------------------------

// One rank alone: each collective leaves its data as it is, so nothing is enqueued. It gives the
// runtime a communicator, and so the hold of a host-placed unit's gradient slab alone
// (swap_in_grads), without a second process.
class one_rank final : public communicator {
 public:
  [[nodiscard]] int rank() const noexcept override { return 0; }
  [[nodiscard]] int size() const noexcept override { return 1; }
  [[nodiscard]] comm_backend backend() const noexcept override { return comm_backend::mpi; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept override { return std::chrono::seconds{60}; }
  void allreduce_many(std::span<const reduce_item> items, stream_view /*s*/, std::string_view /*what*/) override
  {
    // A sum over one rank is its data; the average's factor is 1 / 1 (one contributor).
    for (const reduce_item& i : items) { EXPECT_DOUBLE_EQ(i.op == reduce_op::premul_sum ? i.factor : 1.0, 1.0); }
  }
  void allreduce_counts(std::span<std::int64_t> /*values*/, stream_view /*s*/, std::string_view /*what*/) override {}
  void broadcast(device_span /*data*/, int /*root*/, stream_view /*s*/, std::string_view /*what*/) override {}
  void barrier(stream_view /*s*/) override {}
  [[nodiscard]] std::unique_ptr<communicator> split() override { return std::make_unique<one_rank>(); }
  void check() const override {}
  [[nodiscard]] bool failed() const noexcept override { return false; }
};

// The trained unit's gradient i: nonzero, of both signs.
float gradient(std::size_t i) { return static_cast<float>(1 + i % 4) * (i % 2 == 0 ? 0.25F : -0.25F); }

// The elements of unit k's home that differ from one AdamW step of gradient() from initial().
std::size_t off_first_step(runtime& rt, std::uint32_t k, const adamw_options& o)
{
  const home_view h = rt.home(unit_id{k});
  const auto* p = static_cast<const float*>(h.master.data);
  const auto* m = static_cast<const float*>(h.m.data);
  const auto* v = static_cast<const float*>(h.v.data);
  const auto near = [](double got, double want, double relative) {
    return std::abs(got - want) <= relative * std::abs(want);
  };
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < h.master.count; ++i) {
    const adamw_state want = adamw_reference(initial(k, i), gradient(i), 1, o);
    wrong += near(p[i], want.p, 1e-5) && near(m[i], want.m, 1e-5) && near(v[i], want.v, 1e-4) ? 0U : 1U;
  }
  return wrong;
}

// Unit 0, trained on the device: 64 KiB of parameters, its whole slot 4 granules (extents of 1
// granule, the parameters, and 3). Unit 1, its AdamW on the host and never prefetched: its
// gradient slab 1 granule. Unit 2, frozen: 3 granules. Lookahead 0: each comes in within its step.
std::vector<unit_spec> victim_and_takers()
{
  std::vector<unit_spec> specs(3);
  specs[0].name = "trained";
  specs[0].tensors = {{"w", {elements}}};
  specs[0].policy = unit_policy{residency::prefetch, 0, optimizer_placement::device};
  specs[1].name = "host";
  specs[1].tensors = {{"w", {elements}}};
  specs[1].policy = unit_policy{residency::on_demand, 0, optimizer_placement::host};
  specs[2].name = "frozen";
  specs[2].tensors = {{"w", {3 * elements}}};
  specs[2].trainable = false;
  specs[2].policy = unit_policy{residency::prefetch, 0, optimizer_placement::device};
  return specs;
}

// Unit k's home: initial() parameters and, for a trained unit, m and v zero.
void set_home(runtime& rt, std::uint32_t k)
{
  const home_view h = rt.home(unit_id{k});
  auto* p = static_cast<float*>(h.params.data);
  for (std::size_t i = 0; i < h.params.count; ++i) { p[i] = initial(k, i); }
  for (const slab_view& s : {h.m, h.v}) { std::fill_n(static_cast<float*>(s.data), s.count, 0.0F); }
}

// Trains unit 0 on `s` behind a gate, a backward pass that holds `s` until `open` (10 s at most:
// then `expired`): its update on the runtime's stream, its release and so its write-back wait
// for the gate.
void train_behind_gate(runtime& rt, stream& s, std::atomic<bool>& open, std::atomic<bool>& expired)
{
  const unit_view v = rt.acquire(unit_id{0}, s);
  const slab_view g = v.grads;
  launch_host_func(s, [g] {
    auto* d = static_cast<float*>(g.data);
    for (std::size_t i = 0; i < g.count; ++i) { d[i] = gradient(i); }
  });
  launch_host_func(s, [&open, &expired] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{10};
    while (!open.load()) {
      if (std::chrono::steady_clock::now() > deadline) {
        expired = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
  });
  rt.step(unit_id{0}, s);
  rt.release(unit_id{0}, s);
}

// A budget of 4 granules, all of them the trained unit's slot after step 0, its update not yet
// run (the gate holds the trainer's stream). At step 1's start (end_step) the frozen unit's
// prefetch evicts it (its write-back queued behind the gate) and maps its 3-granule extent; the
// map takes 50 ms on the mapping thread, so that swap-in's copy is pending and its waits, the
// write-back's among them (the extent is shared), go on fill_order, off the list h2d flushes.
// The skip of the host-placed unit then holds its gradient slab alone, in the one free granule:
// the trained unit's parameters, which its write-back has still to read. flush_h2d_waits must
// make that zeroing follow the pending swap-in's waits; without it the zeros run at once, the
// update steps them and the trained unit's home takes the result. Timings: maps of 50 ms against
// a ready check microseconds after the map is queued; a write-back that cannot start before the
// gate opens, whatever the link (an emulated copy reads its source as it starts); a zeroing that
// waits for nothing runs within the 300 ms before the gate opens. With the wait the test passes
// whatever the timing.
TEST(swap_order, a_gradient_slab_in_a_victims_memory_follows_the_write_back_a_pending_swap_in_took_off_h2d)
{
  constexpr std::size_t granule = 64 * KiB;
  emulated_options eo{.memory_bytes = std::size_t{16} << 20, .granularity = granule};
  eo.vm_costs.map = {.per_call_seconds = 0.05, .per_mib_seconds = 0.0};
  const device dev = emulated_device(eo);
  const std::vector<unit_spec> specs = victim_and_takers();
  // The extents the scenario needs: with others no taker shares the victim's memory.
  ASSERT_EQ(footprint(specs[0], optimizer_placement::device).device_bytes, 4 * granule);
  ASSERT_EQ(footprint(specs[0], optimizer_placement::device).param_bytes, granule);
  ASSERT_EQ(footprint(specs[1], optimizer_placement::host).grad_bytes, granule);
  ASSERT_EQ(footprint(specs[2], optimizer_placement::device).device_bytes, 3 * granule);
  runtime_options o;
  o.device.budget = 4 * granule;
  o.optimizer.lr = 1e-2;
  o.comm.initial = initial_sync::verify;  // a broadcast would stage through the pool
  std::atomic<bool> open{false};
  std::atomic<bool> expired{false};
  std::atomic<std::size_t> wrong{0};
  runtime rt(dev, o, specs, std::make_shared<one_rank>());
  ASSERT_EQ(rt.stats().device_granule, granule);
  for (std::uint32_t k = 0; k < specs.size(); ++k) { set_home(rt, k); }
  step_plan second;  // the frozen use first: its prefetch is the first decision of step 1
  second.acquire(unit_id{2}, unit_use::frozen).release(unit_id{2}).acquire(unit_id{1}).release(unit_id{1});
  const std::vector<step_plan> steps{step_plan{unit_id{0}}, second};
  rt.plan(steps);
  stream first(dev);
  train_behind_gate(rt, first, open, expired);
  EXPECT_TRUE(rt.stats().units[0].dirty) << "the trained unit's eviction must write it back";
  (void)rt.end_step();
  EXPECT_EQ(rt.state(unit_id{0}), unit_state::home) << "the frozen unit's prefetch did not evict the trained one";
  EXPECT_EQ(rt.state(unit_id{2}), unit_state::resident);
  EXPECT_EQ(rt.state(unit_id{1}), unit_state::home) << "held whole, the host unit would write no slab alone";
  rt.skip(unit_id{1});  // its gradient slab alone, zeroed, for its update
  EXPECT_EQ(rt.stats().units[1].step, 1) << "the skip did not hold the host unit for its update";
  std::this_thread::sleep_for(std::chrono::milliseconds{300});
  open = true;
  const unit_view f = rt.acquire(unit_id{2}, first, unit_use::frozen);
  launch_host_func(first, [&wrong, f] { wrong += differing(f, 2); });
  rt.release(unit_id{2}, first);
  (void)rt.end_step();
  rt.flush();
  first.synchronize();
  EXPECT_FALSE(expired.load()) << "the gate opened by its deadline: a call waited for the trainer's stream";
  EXPECT_EQ(wrong.load(), 0U) << "elements of the frozen unit that differ from its home";
  EXPECT_EQ(rt.stats().units[0].write_backs, 1U);
  EXPECT_EQ(rt.stats().units[2].swap_ins, 1U);
  EXPECT_EQ(off_first_step(rt, 0, o.optimizer), 0U)
    << "elements of the trained unit's home that differ from one AdamW step: the gradient slab's zeros "
       "reached its parameters before its write-back read them";
  EXPECT_EQ(differing(rt.home(unit_id{2}).params, 2), 0U) << "elements of the frozen unit's home that changed";
}

}  // namespace
}  // namespace taskswap::test
