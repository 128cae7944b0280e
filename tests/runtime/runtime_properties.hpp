// SPDX-License-Identifier: Apache-2.0
#pragma once

// Property tests of the runtime, once per device backend: random units, policies, placements,
// budgets and step scripts, run against a host reference model of AdamW.
//   - device bytes never exceed the budget;
//   - the parameters a trainer sees at every acquire, and every home copy after every flush, are
//     bitwise those of the reference (so swaps are bit-exact and no update is lost or repeated);
//   - any policy and placement gives bitwise the all-resident result;
//   - misses and plans that differ from what runs still work, and nothing deadlocks;
//   - param groups: random lr_scale and weight_decay per unit, a third of the tensors without
//     weight decay, against a reference that steps each tensor with its own settings;
//   - frozen uses (about a third, mixed with trained ones, also of one unit within a step) see the
//     reference's parameters and leave them bitwise unchanged, in budgets that count them at
//     their parameter slab.

#include "host/adamw_formula.hpp"
#include "host/cpu_adamw.hpp"
#include "kernels/kernels.hpp"
#include "test_scale.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace taskswap::test {

// One action of a step script, as the trainer calls it.
struct action {
  enum kind_t { acquire, step, release } kind;
  std::uint32_t unit;
  bool frozen = false;  // an acquisition for a frozen use (forward only)
};

struct scenario {
  std::vector<unit_spec> units;
  std::size_t budget = 0;
  std::vector<std::vector<action>> steps;
  std::vector<step_plan> plans;  // what the trainer announces; may differ from the steps
  enum plan_mode_t { upfront, step_by_step, none } plan_mode = upfront;
  std::uint64_t seed = 0;
};

inline std::size_t device_bytes_of(const unit_spec& u)
{
  // Mirrors runtime/unit_layout: checked against runtime::device_bytes in the tests.
  std::size_t count = 0;
  for (const tensor_spec& t : u.tensors) {
    std::size_t n = 1;
    for (const std::size_t d : t.shape) { n *= d; }
    count = (count + 63) / 64 * 64 + n;
  }
  const auto slab = [&](dtype t) { return (count * size_of(t) + 255) / 256 * 256; };
  const dtype grad = u.grad.value_or(u.compute);
  if (u.policy->optimizer == optimizer_placement::host) { return slab(u.compute) + slab(grad); }
  return slab(u.compute) + (u.compute == dtype::f32 ? 0 : slab(dtype::f32)) + 2 * slab(dtype::f32) + slab(grad);
}

// What an acquisition takes of the budget: the whole slot, or the parameter slab for a frozen use.
inline std::size_t acquired_bytes(const unit_spec& u, bool frozen)
{
  if (!frozen) { return device_bytes_of(u); }
  std::size_t count = 0;
  for (const tensor_spec& t : u.tensors) {
    std::size_t n = 1;
    for (const std::size_t d : t.shape) { n *= d; }
    count = (count + 63) / 64 * 64 + n;
  }
  return (count * size_of(u.compute) + 255) / 256 * 256;
}

inline std::size_t whole_granules(std::size_t bytes, std::size_t granule)
{
  return (bytes + granule - 1) / granule * granule;
}

// What the pinned units take: packed at 256 bytes, in whole granules.
inline std::size_t pinned_taken(const std::vector<unit_spec>& units, std::size_t granule)
{
  std::size_t packed = 0;
  for (const unit_spec& u : units) {
    if (u.policy->residency == residency::pinned) { packed += device_bytes_of(u); }
  }
  return whole_granules(packed, granule);
}

// The least budget the plan check accepts for a script: the most its units hold at once, each in
// whole granules, beside the pinned units. Nothing is added for placement: the pool never splits
// its free room (DESIGN invariant 8).
inline std::size_t exact_budget(const scenario& s, std::size_t granule)
{
  const std::size_t pinned = pinned_taken(s.units, granule);
  std::size_t need = pinned;
  for (const unit_spec& u : s.units) {  // a plan that deviates holds one unit alone
    if (u.policy->residency != residency::pinned) {
      need = std::max(need, pinned + whole_granules(device_bytes_of(u), granule));
    }
  }
  for (const auto& step : s.steps) {
    std::vector<std::pair<std::uint32_t, std::size_t>> held;  // unit, bytes its acquisition takes
    std::size_t held_bytes = 0;
    for (const action& a : step) {
      const unit_spec& u = s.units[a.unit];
      if (u.policy->residency == residency::pinned) { continue; }
      if (a.kind == action::acquire) {
        const std::size_t bytes = whole_granules(acquired_bytes(u, a.frozen), granule);
        held_bytes += bytes;
        need = std::max(need, pinned + held_bytes);
        held.emplace_back(a.unit, bytes);
      } else if (a.kind == action::release) {
        const auto it = std::find_if(held.begin(), held.end(), [&](const auto& h) { return h.first == a.unit; });
        held_bytes -= it->second;
        held.erase(it);
      }
    }
  }
  return need;
}

// `sizes`: the tensors' element counts. The plain scenarios draw up to 2,400 per tensor; the
// heterogeneous ones draw log-uniformly over four orders of magnitude (16 to 160,000 per unit),
// so held units of very different sizes interleave in the pool.
enum class unit_sizes { plain, heterogeneous };

inline scenario random_scenario(std::uint64_t seed, std::size_t granule, bool all_resident = false,
                                unit_sizes sizes = unit_sizes::plain)
{
  std::mt19937_64 rng(seed);
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  scenario s;
  s.seed = seed;
  const std::size_t n_units = 2 + pick(6);
  constexpr std::array dtypes{dtype::f32, dtype::bf16, dtype::f16};
  std::size_t swapped_total = 0;
  for (std::size_t i = 0; i < n_units; ++i) {
    unit_spec u;
    u.name = (i < 2 && pick(2) == 0 ? "trunk/" : "task/") + std::to_string(i);
    const std::size_t tensors = 1 + pick(3);
    const double unit_elements = 16.0 * std::pow(10.0, std::uniform_real_distribution<>(0.0, 4.0)(rng));
    for (std::size_t t = 0; t < tensors; ++t) {
      std::vector<std::size_t> shape{1 + pick(40)};
      if (pick(2) == 0) { shape.push_back(1 + pick(60)); }
      if (sizes == unit_sizes::heterogeneous) {
        shape = {1 + static_cast<std::size_t>(unit_elements / static_cast<double>(tensors))};
      }
      std::string tensor = "w";  // not "w" + std::to_string(t): a false -Wrestrict at -O3 (GCC bug 105651)
      tensor += std::to_string(t);
      u.tensors.push_back({tensor, shape, pick(3) == 0});  // a third without weight decay
    }
    u.compute = dtypes[pick(3)];
    if (u.compute != dtype::f32 && pick(2) == 0) { u.grad = dtype::f32; }
    unit_policy p;
    const auto drawn = static_cast<residency>(pick(3));
    p.residency = all_resident ? residency::pinned : drawn;
    p.lookahead = static_cast<int>(pick(4));
    p.optimizer = static_cast<optimizer_placement>(pick(2));
    constexpr std::array lr_scales{1.0, 0.5, 3.0};  // param groups
    p.lr_scale = lr_scales[pick(3)];
    if (const std::size_t wd = pick(3); wd != 0) { p.weight_decay = wd == 1 ? 0.0 : 0.2; }
    u.policy = p;
    if (p.residency != residency::pinned) { swapped_total += device_bytes_of(u); }
    s.units.push_back(std::move(u));
  }
  const std::size_t n_steps = 1 + pick(10);
  for (std::size_t k = 0; k < n_steps; ++k) {
    std::vector<std::uint32_t> used;
    for (std::uint32_t i = 0; i < n_units; ++i) {
      if (pick(3) == 0) { used.push_back(i); }
    }
    if (used.empty()) { used.push_back(static_cast<std::uint32_t>(pick(n_units))); }
    std::shuffle(used.begin(), used.end(), rng);
    // About a third of the uses are frozen (forward only) in this step.
    std::vector<bool> frozen(n_units, false);
    for (const std::uint32_t u : used) { frozen[u] = pick(3) == 0; }
    std::vector<action> step;
    step_plan plan;
    if (pick(2) == 0) {  // hold everything for the step, release in reverse
      for (const std::uint32_t u : used) { step.push_back({action::acquire, u, frozen[u]}); }
      for (auto it = used.rbegin(); it != used.rend(); ++it) {
        if (!frozen[*it] && pick(4) != 0) { step.push_back({action::step, *it}); }
        step.push_back({action::release, *it});
      }
    } else {  // stream: forward one at a time (frozen or not), then backward for the trained ones
      for (const std::uint32_t u : used) {
        step.push_back({action::acquire, u, frozen[u] || pick(2) == 0});
        step.push_back({action::release, u});
      }
      for (auto it = used.rbegin(); it != used.rend(); ++it) {
        if (frozen[*it]) { continue; }
        step.push_back({action::acquire, *it});
        if (pick(4) != 0) { step.push_back({action::step, *it}); }
        step.push_back({action::release, *it});
      }
    }
    for (const action& a : step) {
      if (a.kind == action::acquire) { plan.acquire(unit_id{a.unit}, a.frozen ? unit_use::frozen : unit_use::train); }
      if (a.kind == action::release) { plan.release(unit_id{a.unit}); }
    }
    if (pick(8) == 0) {  // the trainer changes its mind: announce another unit's step instead
      plan = step_plan{unit_id{static_cast<std::uint32_t>(pick(n_units))}};
    }
    s.steps.push_back(std::move(step));
    s.plans.push_back(std::move(plan));
  }
  s.plan_mode = static_cast<scenario::plan_mode_t>(pick(3));
  // Half the budgets are exactly what the check needs, a quarter a little more (less than a
  // granule: what the pool cannot use), a quarter more room to prefetch in.
  s.budget = exact_budget(s, granule);
  switch (pick(4)) {
    case 0: s.budget += pick(granule); break;
    case 1: s.budget += pick(swapped_total + 1); break;
    default: break;
  }
  return s;
}

// The reference: every unit's state on the host, stepped by the portable CPU AdamW.
struct reference_unit {
  std::vector<tensor_info> tensors;  // offsets and weight-decay flags
  unit_policy policy{};
  std::vector<float> master, m, v;
  std::vector<std::byte> params;  // compute dtype
  dtype compute = dtype::f32;
  std::int64_t step = 0;
};

template <typename Backend>
class runtime_properties : public ::testing::Test {
 public:  // for the helpers below
  void SetUp() override
  {
    if (const std::string why = Backend::skip_reason(); !why.empty()) { GTEST_SKIP() << why; }
  }

  struct outcome {
    std::vector<reference_unit> homes;  // as flushed from the runtime at the end
  };
  static std::size_t backend_granule() { return Backend::granule(); }

  // Runs `s`; checks every acquire against the reference and, with `flush_each_step`, every home.
  void run(const scenario& s, bool flush_each_step, outcome* out = nullptr)
  {
    SCOPED_TRACE("scenario seed " + std::to_string(s.seed));
    device dev = Backend::make(s.budget);
    runtime_options options;
    options.device.budget = s.budget;
    options.optimizer = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.05};
    runtime rt(dev, options, s.units);
    stream compute(dev);
    std::mt19937_64 rng(s.seed ^ 0x9e3779b97f4a7c15ULL);
    std::uniform_real_distribution<float> dist(-1.0F, 1.0F);

    std::vector<reference_unit> ref(s.units.size());
    for (std::uint32_t i = 0; i < s.units.size(); ++i) {
      const unit_id id{i};
      EXPECT_EQ(rt.device_bytes(id), device_bytes_of(s.units[i]));
      home_view h = rt.home(id);
      reference_unit& r = ref[i];
      r.tensors.assign(h.tensors.begin(), h.tensors.end());
      r.policy = rt.policy(id);
      r.master.resize(h.master.count);
      for (float& x : r.master) { x = dist(rng); }
      std::memcpy(h.master.data, r.master.data(), r.master.size() * sizeof(float));
      r.m.assign(h.m.count, 0.0F);
      r.v.assign(h.v.count, 0.0F);
      r.params.resize(h.params.bytes());
      r.compute = h.params.type;
      if (h.params.type == dtype::f32) {
        std::memcpy(r.params.data(), r.master.data(), r.params.size());
      } else {
        detail::host_cast(r.params.data(), h.params.type, r.master.data(), dtype::f32, r.master.size());
      }
    }
    if (s.plan_mode == scenario::upfront) { rt.plan(s.plans); }

    const std::size_t budget = s.budget;
    for (std::size_t k = 0; k < s.steps.size(); ++k) {
      SCOPED_TRACE("step " + std::to_string(k));
      if (s.plan_mode == scenario::step_by_step) { rt.plan(s.plans[k]); }
      std::vector<pinned_buffer> staging;
      std::vector<std::pair<std::size_t, std::vector<std::byte>>> expected_params;  // staging index, bytes
      std::vector<unit_view> views(s.units.size());
      for (const action& a : s.steps[k]) {
        const unit_id id{a.unit};
        if (a.kind == action::acquire) {
          views[a.unit] = rt.acquire(id, compute, a.frozen ? unit_use::frozen : unit_use::train);
          EXPECT_EQ(views[a.unit].frozen, a.frozen);
          EXPECT_EQ(views[a.unit].grads.data == nullptr, a.frozen);
          const slab_view p = views[a.unit].params;
          staging.emplace_back(dev, p.bytes());
          copy_async(staging.back().span(),
                     const_device_span(device_span(&dev.backend(), static_cast<std::byte*>(p.data), p.bytes())),
                     compute);
          expected_params.emplace_back(staging.size() - 1, ref[a.unit].params);
        } else if (a.kind == action::step) {
          const slab_view g = views[a.unit].grads;
          std::vector<float> grads(g.count);
          for (float& x : grads) { x = dist(rng); }
          staging.emplace_back(dev, g.bytes());
          detail::host_cast(staging.back().data(), g.type, grads.data(), dtype::f32, g.count);
          copy_async(device_span(&dev.backend(), static_cast<std::byte*>(g.data), g.bytes()),
                     std::span<const std::byte>(staging.back().data(), g.bytes()), compute);
          rt.grads_ready(id, compute);
          rt.step(id, compute);
          reference_step(ref[a.unit], staging.back().data(), g.type, options.optimizer);
        } else {
          rt.release(id, compute);
        }
        EXPECT_LE(rt.stats().device_bytes_in_use, budget);
      }
      const step_stats st = rt.end_step();
      EXPECT_LE(st.peak_device_bytes, budget);
      compute.synchronize();
      for (const auto& [index, bytes] : expected_params) {
        ASSERT_EQ(std::memcmp(staging[index].data(), bytes.data(), bytes.size()), 0)
          << "device parameters at acquire differ from the reference";
      }
      if (flush_each_step) {
        rt.flush();
        expect_homes_equal(rt, ref);
      }
    }
    rt.flush();
    expect_homes_equal(rt, ref);
    const runtime_stats stats = rt.stats();
    EXPECT_LE(stats.total.peak_device_bytes, budget);
    seen_.hits += stats.total.hits;
    seen_.misses += stats.total.misses;
    seen_.unplanned += stats.total.unplanned;
    seen_.frozen += stats.total.frozen;
    seen_.evictions += stats.total.evictions;
    seen_.write_backs += stats.total.write_backs;
    seen_.d2h_bytes += stats.total.d2h_bytes;  // write-backs and host-placement gradients
    if (out != nullptr) {
      for (std::uint32_t i = 0; i < s.units.size(); ++i) { out->homes.push_back(snapshot(rt.home(unit_id{i}))); }
    }
  }

  // What the scenarios exercised, so that a generator that stops producing evictions, misses or
  // write-backs is noticed.
  void expect_every_path_was_taken() const
  {
    EXPECT_GT(seen_.hits, 0U);
    EXPECT_GT(seen_.misses, 0U);
    EXPECT_GT(seen_.unplanned, 0U);
    EXPECT_GT(seen_.frozen, 0U);
    EXPECT_GT(seen_.evictions, 0U);
    EXPECT_GT(seen_.write_backs, 0U);
    EXPECT_GT(seen_.d2h_bytes, 0U);
  }
  step_stats seen_{};

  // AdamW over the slab with the unit's group settings; each tensor, and the alignment gap after it,
  // with or without weight decay as the tensor says.
  static void reference_step(reference_unit& r, const void* grads, dtype grad_type, const adamw_options& optimizer)
  {
    ++r.step;
    adamw_options o = optimizer;
    o.lr *= r.policy.lr_scale;
    if (r.policy.weight_decay) { o.weight_decay = *r.policy.weight_decay; }
    adamw_options plain = o;
    plain.weight_decay = 0;
    detail::adamw_slabs slabs;
    slabs.master = r.master.data();
    slabs.m = r.m.data();
    slabs.v = r.v.data();
    slabs.grad = grads;
    slabs.grad_type = grad_type;
    slabs.params = nullptr;
    slabs.count = r.master.size();
    for (std::size_t t = 0; t < r.tensors.size(); ++t) {
      const std::size_t begin = t == 0 ? 0 : r.tensors[t].offset;
      const std::size_t end = t + 1 < r.tensors.size() ? r.tensors[t + 1].offset : slabs.count;
      const adamw_options& settings = r.tensors[t].no_weight_decay ? plain : o;
      detail::cpu_adamw_range(slabs, detail::make_adamw_scalars(settings, r.step), begin, end,
                              detail::cpu_isa::portable);
    }
    if (r.compute == dtype::f32) {
      std::memcpy(r.params.data(), r.master.data(), r.params.size());
    } else {
      detail::host_cast(r.params.data(), r.compute, r.master.data(), dtype::f32, r.master.size());
    }
  }

  static reference_unit snapshot(const home_view& h)
  {
    reference_unit r;
    const auto* master = static_cast<const float*>(h.master.data);
    r.master.assign(master, master + h.master.count);
    r.m.assign(static_cast<const float*>(h.m.data), static_cast<const float*>(h.m.data) + h.m.count);
    r.v.assign(static_cast<const float*>(h.v.data), static_cast<const float*>(h.v.data) + h.v.count);
    const auto* p = static_cast<const std::byte*>(h.params.data);
    r.params.assign(p, p + h.params.bytes());
    r.compute = h.params.type;
    r.step = h.step;
    return r;
  }

  static void expect_homes_equal(runtime& rt, const std::vector<reference_unit>& ref)
  {
    for (std::uint32_t i = 0; i < ref.size(); ++i) {
      const reference_unit got = snapshot(rt.home(unit_id{i}));
      SCOPED_TRACE("unit " + std::string(rt.name(unit_id{i})));
      ASSERT_EQ(got.step, ref[i].step);
      ASSERT_TRUE(got.master == ref[i].master || bitwise_equal(got.master, ref[i].master)) << "master differs";
      ASSERT_TRUE(bitwise_equal(got.m, ref[i].m)) << "m differs";
      ASSERT_TRUE(bitwise_equal(got.v, ref[i].v)) << "v differs";
      ASSERT_TRUE(got.params == ref[i].params) << "params differ";
    }
  }

  static bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b)
  {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }
};

TYPED_TEST_SUITE_P(runtime_properties);

TYPED_TEST_P(runtime_properties, random_scenarios_match_the_reference_after_every_step)
{
  const std::size_t cases = large_case(1500, 120);
  for (std::uint64_t seed = 1; seed <= cases; ++seed) {
    this->run(random_scenario(seed, TypeParam::granule()), /*flush_each_step=*/true);
    if (this->HasFatalFailure()) { return; }
  }
  this->expect_every_path_was_taken();
}

// Swapped against all-resident, on the same seed: the parameters must be bitwise equal.
template <typename Fixture>
void expect_swapped_equals_resident(Fixture& f, std::uint64_t seed, unit_sizes sizes)
{
  const std::size_t granule = Fixture::backend_granule();
  const scenario swapped = random_scenario(seed, granule, false, sizes);
  scenario resident = random_scenario(seed, granule, /*all_resident=*/true, sizes);
  resident.budget = pinned_taken(resident.units, granule);
  typename Fixture::outcome a;
  typename Fixture::outcome b;
  f.run(swapped, /*flush_each_step=*/false, &a);
  f.run(resident, /*flush_each_step=*/false, &b);
  if (f.HasFatalFailure()) { return; }
  for (std::size_t i = 0; i < a.homes.size(); ++i) {
    ASSERT_EQ(a.homes[i].params, b.homes[i].params) << "seed " << seed << " unit " << i;
    ASSERT_TRUE(Fixture::bitwise_equal(a.homes[i].master, b.homes[i].master)) << "seed " << seed << " unit " << i;
  }
}

TYPED_TEST_P(runtime_properties, any_policy_gives_the_all_resident_parameters)
{
  const std::size_t cases = large_case(600, 60);
  for (std::uint64_t seed = 10'001; seed < 10'001 + cases; ++seed) {
    expect_swapped_equals_resident(*this, seed, unit_sizes::plain);
    if (this->HasFatalFailure()) { return; }
  }
  this->expect_every_path_was_taken();
}

// DESIGN invariant 8: units over four orders of magnitude, held together in budgets the check
// accepts with nothing to spare. No acquire may fail (an out_of_memory fails the test), the budget
// is never exceeded (run() checks it after every call), and the result is the all-resident one.
TYPED_TEST_P(runtime_properties, units_of_any_size_never_fail_for_placement_in_a_budget_the_check_accepts)
{
  const std::size_t cases = large_case(1000, 60);
  for (std::uint64_t seed = 20'001; seed < 20'001 + cases; ++seed) {
    expect_swapped_equals_resident(*this, seed, unit_sizes::heterogeneous);
    if (this->HasFatalFailure()) { return; }
  }
  this->expect_every_path_was_taken();
}

REGISTER_TYPED_TEST_SUITE_P(runtime_properties, random_scenarios_match_the_reference_after_every_step,
                            any_policy_gives_the_all_resident_parameters,
                            units_of_any_size_never_fail_for_placement_in_a_budget_the_check_accepts);

}  // namespace taskswap::test
