// SPDX-License-Identifier: Apache-2.0
// The active-gradient reducer over MPI on emulated devices; run under mpirun (-np 2 and -np 4).
//
// Every rank trains the same model (two trunk units and five heads) on its own schedule and
// writes known gradients. Each rank also computes, in process, what a single process that sums
// the ranks' gradients would get, and checks its home copies against it; the ranks then compare
// their home copies with each other bitwise.

#include "expect_error.hpp"
#include "host/adamw_formula.hpp"
#include "numeric/dtype_conversion.hpp"
#include "mpi_test.hpp"
#include "test_scale.hpp"

#include <taskswap/comm.hpp>
#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::chrono::milliseconds test_timeout{60'000};

std::vector<unit_spec> model(std::size_t head_rows = 16)
{
  const auto unit = [](std::string name, std::vector<tensor_spec> t, dtype compute, std::optional<dtype> grad,
                       residency res, optimizer_placement place) {
    unit_spec u;
    u.name = std::move(name);
    u.tensors = std::move(t);
    u.compute = compute;
    u.grad = grad;
    u.policy = unit_policy{.residency = res, .lookahead = 1, .optimizer = place};
    return u;
  };
  std::vector<unit_spec> units;
  units.push_back(
    unit("trunk0", {{"w", {24, 16}}, {"b", {17}}}, dtype::f32, {}, residency::pinned, optimizer_placement::device));
  units.push_back(
    unit("trunk1", {{"w", {16, 16}}}, dtype::bf16, dtype::f32, residency::pinned, optimizer_placement::device));
  units.push_back(
    unit("head0", {{"w", {head_rows, 8}}}, dtype::f32, {}, residency::prefetch, optimizer_placement::device));
  units.push_back(
    unit("head1", {{"w", {head_rows, 8}}}, dtype::f32, {}, residency::on_demand, optimizer_placement::device));
  units.push_back(
    unit("head2", {{"w", {head_rows, 8}}}, dtype::bf16, {}, residency::prefetch, optimizer_placement::device));
  units.push_back(
    unit("head3", {{"w", {head_rows, 8}}}, dtype::f32, {}, residency::prefetch, optimizer_placement::host));
  units.push_back(
    unit("head4", {{"w", {head_rows, 8}}}, dtype::f32, {}, residency::prefetch, optimizer_placement::device));
  return units;
}

constexpr std::uint32_t first_head = 2;
constexpr std::uint32_t trained_heads = 4;  // head4 is never trained

// The gradient rank `rank` writes for element i of unit u in step k: multiples of 1/8, exact in bf16.
float gradient(int rank, std::uint64_t k, std::uint32_t u, std::size_t i)
{
  return static_cast<float>(rank + 1) * 0.25F + static_cast<float>((i * 7 + k * 3 + u) % 11) * 0.125F - 0.75F;
}

enum class schedule { homogeneous, heterogeneous };

struct run_options {
  schedule kind = schedule::homogeneous;
  std::size_t bucket_cap = std::size_t{25} << 20;
  bool plan_upfront = true;
  average_mode average = average_mode::contributors;
  std::uint64_t steps = 10;
  bool freeze = false;  // frozen uses: the trunk from step freeze_trunk_at, and heads other ranks train
};

constexpr std::uint64_t freeze_trunk_at = 4;

// The head rank `rank` trains in step k; a rank may plan it and then not acquire it (it still
// counts as a contributor of zeros).
std::uint32_t head_of(const run_options& o, int rank, std::uint64_t k)
{
  const std::uint64_t t = o.kind == schedule::homogeneous ? (k * 5 + 1) : (k + static_cast<std::uint64_t>(rank));
  return first_head + static_cast<std::uint32_t>(t % trained_heads);
}

bool skips_head(const run_options& o, int rank, std::uint64_t k)
{
  return o.kind == schedule::heterogeneous && k % 5 == 4 && rank == world_size() - 1;
}

// A learning-rate schedule: set between steps, it must reach every rank's updates alike.
float lr_of(std::uint64_t k) { return 1e-2F * static_cast<float>(1 + k % 3); }

bool trunk_frozen(const run_options& o, std::uint64_t k) { return o.freeze && k >= freeze_trunk_at; }

// The heads `rank` uses frozen in step k (with `freeze`): the next rank's head, which that rank
// trains in the same step (this replica takes its update after the frozen use), and every third
// step head4, which nobody trains (it costs no bytes anywhere).
std::vector<std::uint32_t> frozen_heads_of(const run_options& o, int rank, std::uint64_t k)
{
  std::vector<std::uint32_t> heads;
  if (!o.freeze) { return heads; }
  const std::uint32_t next = head_of(o, (rank + 1) % world_size(), k);
  if (next != head_of(o, rank, k)) { heads.push_back(next); }
  if (k % 3 == 0) { heads.push_back(first_head + trained_heads); }
  return heads;
}

step_plan plan_of(const run_options& o, int rank, std::uint64_t k)
{
  const unit_use trunk = trunk_frozen(o, k) ? unit_use::frozen : unit_use::train;
  step_plan p;
  p.acquire(unit_id{0}, trunk).acquire(unit_id{1}, trunk).acquire(unit_id{head_of(o, rank, k)});
  for (const std::uint32_t h : frozen_heads_of(o, rank, k)) { p.acquire(unit_id{h}, unit_use::frozen); }
  return p;
}

struct home_state {
  std::vector<float> master, m, v;
  std::int64_t step = 0;
};

home_state read_home(runtime& rt, unit_id u)
{
  const home_view h = rt.home(u);
  const auto copy = [](const slab_view& s) {
    std::vector<float> out(s.count);
    std::memcpy(out.data(), s.data, s.count * sizeof(float));
    return out;
  };
  return {copy(h.master), copy(h.m), copy(h.v), h.step};
}

void init_home(runtime& rt)
{
  for (std::uint32_t u = 0; u < rt.unit_count(); ++u) {
    const home_view h = rt.home(unit_id{u});
    auto* master = static_cast<float*>(h.master.data);
    for (std::size_t i = 0; i < h.master.count; ++i) { master[i] = 0.01F * static_cast<float>((i + u) % 17) - 0.05F; }
  }
}

runtime_options options_for(const run_options& o, std::size_t budget)
{
  runtime_options opt;
  opt.device.backend = backend_kind::emulated;
  opt.device.budget = budget;
  opt.comm.backend = comm_backend::mpi;
  opt.comm.bucket_cap = o.bucket_cap;
  opt.comm.average = o.average;
  opt.comm.timeout = test_timeout;
  opt.optimizer.lr = 1e-2F;
  opt.optimizer.weight_decay = 0.1F;
  return opt;
}

// Pinned trunk plus room for two heads at a time: heads swap, and update-only heads must fit.
std::size_t budget_for(const std::vector<unit_spec>& units)
{
  runtime_options probe;
  probe.device.backend = backend_kind::emulated;
  probe.device.budget = std::size_t{64} << 20;
  runtime rt(emulated_device({.memory_bytes = probe.device.budget}), probe, units);
  std::size_t head = 0;
  for (std::uint32_t u = first_head; u < rt.unit_count(); ++u) { head = std::max(head, rt.device_bytes(unit_id{u})); }
  // Each step holds this rank's head and the heads only other ranks train: up to one per rank.
  return rt.device_bytes(unit_id{0}) + rt.device_bytes(unit_id{1}) +
         (static_cast<std::size_t>(world_size()) + 1) * head;
}

void write_gradients(const unit_view& v, int rank, std::uint64_t k, stream_view s)
{
  launch_host_func(s, [v, rank, k] {
    for (std::size_t i = 0; i < v.grads.count; ++i) {
      detail::narrow_element(v.grads.data, v.grads.type, i, gradient(rank, k, v.id.value, i));
    }
  });
}

struct outcome {
  std::vector<home_state> homes;
  runtime_stats stats;
};

outcome train(const run_options& o)
{
  const int me = world_rank();
  const std::vector<unit_spec> units = model();
  const runtime_options opt = options_for(o, budget_for(units));
  const device dev = make_device(opt.device);
  runtime rt(dev, opt, units);
  init_home(rt);
  stream compute(dev);
  if (o.plan_upfront) {
    std::vector<step_plan> plans;
    for (std::uint64_t k = 0; k < o.steps; ++k) { plans.push_back(plan_of(o, me, k)); }
    rt.plan(plans);
  }
  for (std::uint64_t k = 0; k < o.steps; ++k) {
    adamw_options schedule = opt.optimizer;
    schedule.lr = lr_of(k);
    rt.set_optimizer(schedule);
    if (!o.plan_upfront) { rt.plan(plan_of(o, me, k)); }
    std::vector<std::pair<std::uint32_t, unit_use>> order;
    for (const std::uint32_t u : {0U, 1U}) {
      order.emplace_back(u, trunk_frozen(o, k) ? unit_use::frozen : unit_use::train);
    }
    if (!skips_head(o, me, k)) { order.emplace_back(head_of(o, me, k), unit_use::train); }
    for (const std::uint32_t h : frozen_heads_of(o, me, k)) { order.emplace_back(h, unit_use::frozen); }
    std::vector<unit_view> views;
    for (const auto& [u, use] : order) { views.push_back(rt.acquire(unit_id{u}, compute, use)); }
    for (std::size_t i = order.size(); i-- > 0;) {  // backward: the heads, then the trunk top down
      const std::uint32_t u = order[i].first;
      if (views[i].frozen) {  // forward only: no gradients, no step
        rt.release(unit_id{u}, compute);
        continue;
      }
      write_gradients(views[i], me, k, compute);
      rt.grads_ready(unit_id{u}, compute);
      rt.step(unit_id{u}, compute);
      rt.release(unit_id{u}, compute);
    }
    const step_stats st = rt.end_step();
    if (trunk_frozen(o, k)) {  // from the freeze on, only heads travel
      EXPECT_LE(st.reduced_bytes, static_cast<std::size_t>(world_size()) * 16 * 8 * sizeof(float)) << "step " << k;
    }
  }
  rt.flush();
  compute.synchronize();
  outcome out;
  for (std::uint32_t u = 0; u < rt.unit_count(); ++u) { out.homes.push_back(read_home(rt, unit_id{u})); }
  out.stats = rt.stats();
  return out;
}

// What one process computes from every rank's gradients: for each unit trained in a step, the
// ranks' gradients times 1 / contributors (or 1 / world), summed, then AdamW.
struct reference {
  std::vector<home_state> homes;
  std::size_t reduced_bytes = 0;
};

reference reference_of(const run_options& o, const runtime_options& opt, const std::vector<home_state>& initial,
                       const std::vector<std::size_t>& counts, const std::vector<dtype>& grad_types)
{
  const int world = world_size();
  reference ref{initial, 0};
  for (std::uint64_t k = 0; k < o.steps; ++k) {
    std::map<std::uint32_t, std::vector<int>> trained;  // unit -> contributing ranks
    for (int r = 0; r < world; ++r) {  // frozen uses contribute nothing
      if (!trunk_frozen(o, k)) {
        trained[0].push_back(r);
        trained[1].push_back(r);
      }
      trained[head_of(o, r, k)].push_back(r);
    }
    for (const auto& [u, ranks] : trained) {
      home_state& h = ref.homes[u];
      const dtype t = grad_types[u];
      const float factor = opt.comm.average == average_mode::world ? 1.0F / static_cast<float>(world)
                                                                   : 1.0F / static_cast<float>(ranks.size());
      ref.reduced_bytes += counts[u] * size_of(t);
      ++h.step;
      adamw_options schedule = opt.optimizer;
      schedule.lr = lr_of(k);
      const detail::adamw_scalars sc = detail::make_adamw_scalars(schedule, h.step);
      for (std::size_t i = 0; i < h.master.size(); ++i) {
        std::uint16_t half = 0;
        float sum = 0;
        bool first = true;
        for (const int r : ranks) {
          const bool zero = u == head_of(o, r, k) && skips_head(o, r, k);
          float c = zero ? 0.0F : gradient(r, k, u, i);
          if (t != dtype::f32) {  // the gradient and its premultiplied value are rounded to the type
            detail::narrow_element(&half, t, 0, c);
            detail::narrow_element(&half, t, 0, detail::widen_element(&half, t, 0) * factor);
            c = detail::widen_element(&half, t, 0);
          } else {
            c *= factor;
          }
          if (first) {
            sum = c;
            first = false;
          } else if (t == dtype::f32) {
            sum += c;
          } else {
            detail::narrow_element(&half, t, 0, sum + c);
            sum = detail::widen_element(&half, t, 0);
          }
        }
        detail::adamw_element(sum, h.master[i], h.m[i], h.v[i], sc);
      }
    }
  }
  return ref;
}

void expect_matches_reference(const run_options& o)
{
  const std::vector<unit_spec> units = model();
  const runtime_options opt = options_for(o, budget_for(units));
  // The initial homes and element counts, from a runtime that does not communicate.
  runtime_options local = opt;
  local.comm.backend = comm_backend::none;
  runtime probe(make_device(local.device), local, units);
  init_home(probe);
  std::vector<home_state> initial;
  std::vector<std::size_t> counts;
  std::vector<dtype> grad_types;
  for (std::uint32_t u = 0; u < probe.unit_count(); ++u) {
    initial.push_back(read_home(probe, unit_id{u}));
    counts.push_back(initial.back().master.size());
    grad_types.push_back(units[u].grad.value_or(units[u].compute));
  }

  const outcome got = train(o);
  const reference want = reference_of(o, opt, initial, counts, grad_types);
  const bool exact = world_size() == 2;  // with more ranks MPI may add in another order
  for (std::uint32_t u = 0; u < got.homes.size(); ++u) {
    const home_state& g = got.homes[u];
    const home_state& w = want.homes[u];
    EXPECT_EQ(g.step, w.step) << units[u].name;
    std::size_t wrong = 0;
    std::size_t first_wrong = 0;
    for (std::size_t i = 0; i < g.master.size(); ++i) {
      const bool ok = exact ? g.master[i] == w.master[i] && g.v[i] == w.v[i]
                            : std::abs(g.master[i] - w.master[i]) <= 1e-5F + 1e-4F * std::abs(w.master[i]);
      if (!ok && wrong++ == 0) { first_wrong = i; }
    }
    EXPECT_EQ(wrong, 0U) << units[u].name << ": " << wrong << " of " << g.master.size()
                         << " elements differ from the reference, the first at " << first_wrong << " ("
                         << g.master[first_wrong] << " instead of " << w.master[first_wrong] << ")";
  }
  // head4 is trained by nobody: not a bit of it moved.
  const home_state& idle = got.homes[first_head + trained_heads];
  const home_state& idle0 = initial[first_head + trained_heads];
  EXPECT_EQ(idle.step, 0);
  EXPECT_EQ(0, std::memcmp(idle.master.data(), idle0.master.data(), idle.master.size() * sizeof(float)));
  EXPECT_TRUE(std::all_of(idle.m.begin(), idle.m.end(), [](float x) { return x == 0.0F; }));
  EXPECT_TRUE(std::all_of(idle.v.begin(), idle.v.end(), [](float x) { return x == 0.0F; }));
  // Only the active units' gradients travel, against the whole model for a reduce-everything one.
  EXPECT_EQ(got.stats.total.reduced_bytes, want.reduced_bytes);
  // The counters are what travels: footprint().reduce_bytes, not the slab (trunk0's 401 f32
  // elements leave 1792 - 1604 bytes of tail padding in its gradient slab).
  std::size_t model_bytes = 0;
  for (std::uint32_t u = 0; u < counts.size(); ++u) {
    model_bytes += counts[u] * size_of(grad_types[u]);
    EXPECT_EQ(footprint(units[u], optimizer_placement::device).reduce_bytes, counts[u] * size_of(grad_types[u]))
      << units[u].name;
  }
  EXPECT_LT(footprint(units[0], optimizer_placement::device).reduce_bytes,
            footprint(units[0], optimizer_placement::device).grad_bytes);
  EXPECT_EQ(got.stats.total.reduce_all_bytes, model_bytes * o.steps);

  // Replicas: every rank's home copies are bitwise rank 0's.
  for (std::uint32_t u = 0; u < got.homes.size(); ++u) {
    for (const std::vector<float>* slab : {&got.homes[u].master, &got.homes[u].m, &got.homes[u].v}) {
      std::vector<float> root = *slab;
      MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
      ASSERT_EQ(0, std::memcmp(root.data(), slab->data(), root.size() * sizeof(float)))
        << "rank " << world_rank() << " differs from rank 0 in " << units[u].name;
    }
  }
}

TEST(reducer_mpi, homogeneous_schedule_matches_the_summed_reference)
{
  expect_matches_reference({.kind = schedule::homogeneous});
}

TEST(reducer_mpi, heterogeneous_schedule_matches_the_summed_reference)
{
  expect_matches_reference({.kind = schedule::heterogeneous, .plan_upfront = false});
}

TEST(reducer_mpi, one_unit_per_bucket_and_world_average)
{
  // Buckets of one unit each: every step() finds its reduction launched (no deferred update).
  expect_matches_reference({.kind = schedule::heterogeneous, .bucket_cap = 256, .average = average_mode::world});
}

TEST(reducer_mpi, frozen_uses_cost_nothing_and_a_unit_frozen_here_takes_the_update_of_the_ranks_that_train_it)
{
  // The trunk is frozen from step 4 on every rank (fine-tuning the heads); each rank also uses the
  // next rank's head frozen while that rank trains it, and head4 (trained by nobody) frozen.
  expect_matches_reference({.kind = schedule::heterogeneous, .freeze = true});
  expect_matches_reference(
    {.kind = schedule::homogeneous, .plan_upfront = false, .average = average_mode::world, .freeze = true});
}

TEST(reducer_mpi, a_frozen_use_must_be_acquired_as_planned_and_is_never_stepped)
{
  const std::vector<unit_spec> units = model();
  const runtime_options opt = options_for({}, budget_for(units));
  const device dev = make_device(opt.device);
  runtime rt(dev, opt, units);
  stream compute(dev);
  rt.plan(step_plan{}.acquire(unit_id{0}, unit_use::frozen).acquire(unit_id{first_head}));
  expect_error_mentioning<invalid_argument>([&] { (void)rt.acquire(unit_id{0}, compute); }, "planned it frozen");
  const unit_view trunk = rt.acquire(unit_id{0}, compute, unit_use::frozen);
  EXPECT_TRUE(trunk.frozen);
  EXPECT_EQ(trunk.grads.count, 0U);
  expect_error_mentioning<invalid_argument>([&] { (void)trunk.grad(0); }, "used frozen");
  expect_error_mentioning<invalid_argument>([&] { rt.grads_ready(unit_id{0}, compute); }, "used frozen");
  expect_error_mentioning<invalid_argument>([&] { rt.step(unit_id{0}, compute); }, "used frozen");
  const unit_view head = rt.acquire(unit_id{first_head}, compute);
  write_gradients(head, world_rank(), 0, compute);
  rt.step(unit_id{first_head}, compute);
  rt.release(unit_id{first_head}, compute);
  rt.release(unit_id{0}, compute);
  const step_stats st = rt.end_step();
  EXPECT_EQ(st.frozen, 1U);
  EXPECT_EQ(st.reduced_bytes, footprint(units[first_head], optimizer_placement::device).reduce_bytes);
  rt.flush();
  EXPECT_EQ(rt.stats().units[0].step, 0);
  EXPECT_EQ(rt.stats().units[first_head].step, 1);
}

TEST(reducer_mpi, a_host_placed_unit_only_others_train_moves_only_its_gradient)
{
  // Rank 0 trains head "a", the others head "b"; both heads have host placement and are not
  // resident. On the other ranks "a" is updated from its reduced gradient without its
  // parameters ever coming to the device.
  const int me = world_rank();
  std::vector<unit_spec> units = model();
  units.resize(first_head + 2);
  for (std::uint32_t u = first_head; u < units.size(); ++u) {
    units[u].policy =
      unit_policy{.residency = residency::on_demand, .lookahead = 0, .optimizer = optimizer_placement::host};
  }
  const runtime_options opt = options_for({}, budget_for(units));
  const device dev = make_device(opt.device);
  runtime rt(dev, opt, units);
  EXPECT_EQ(rt.rank(), me);
  EXPECT_EQ(rt.world_size(), world_size());
  init_home(rt);
  stream compute(dev);
  const unit_id a{first_head};
  const unit_id b{first_head + 1};
  const unit_id mine = me == 0 ? a : b;
  rt.plan(step_plan{unit_id{0}, mine});
  const unit_view trunk = rt.acquire(unit_id{0}, compute);
  const unit_view head = rt.acquire(mine, compute);
  for (const auto& [u, v] : {std::pair{mine, head}, std::pair{unit_id{0}, trunk}}) {
    write_gradients(v, me, 0, compute);
    rt.grads_ready(u, compute);
    rt.step(u, compute);
    rt.release(u, compute);
  }
  (void)rt.end_step();
  rt.flush();
  const runtime_stats st = rt.stats();
  EXPECT_EQ(st.units[a.value].step, 1);
  EXPECT_EQ(st.units[a.value].swap_ins, me == 0 ? 1U : 0U) << "rank " << me;
  EXPECT_EQ(st.units[a.value].state, unit_state::home);
  // The CPU updates agree: rank 0's "a" (trained, gradient reduced with zeros) is everyone's.
  const home_state h = read_home(rt, a);
  std::vector<float> root = h.master;
  MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(0, std::memcmp(root.data(), h.master.data(), root.size() * sizeof(float))) << "rank " << me;
}

// State tensors (running statistics) are written on each rank during its forward pass; after the
// reduction every rank holds those of the lowest rank that trained the unit (rank 0's for a and
// b, as DDP's broadcast_buffers; rank 1's for c, which rank 0 never trains), AdamW never touches
// them, and they come home with the update: device and host placement, f32 and bf16.
TEST(reducer_mpi, state_tensors_take_rank_0s_values_and_are_never_stepped)
{
  const int me = world_rank();
  const auto unit = [](std::string name, dtype compute, optimizer_placement place) {
    unit_spec u;
    u.name = std::move(name);
    u.tensors = {{"running", {5}, false, true}, {"w", {8, 4}}, {"b", {4}, true}};
    u.compute = compute;
    u.policy = unit_policy{.residency = residency::on_demand, .lookahead = 0, .optimizer = place};
    return u;
  };
  const std::vector<unit_spec> units{unit("a", dtype::f32, optimizer_placement::device),
                                     unit("b", dtype::bf16, optimizer_placement::host),
                                     unit("c", dtype::f32, optimizer_placement::device)};
  const runtime_options opt = options_for({}, budget_for(units));
  const device dev = make_device(opt.device);
  runtime rt(dev, opt, units);
  init_home(rt);
  stream compute(dev);
  constexpr int steps = 3;
  std::vector<step_plan> plans(
    steps, me == 0 ? step_plan{unit_id{0}, unit_id{1}} : step_plan{unit_id{0}, unit_id{1}, unit_id{2}});
  if (me == 1) { plans[1] = step_plan{unit_id{0}, unit_id{2}}; }  // rank 1 only takes b's update in step 1
  rt.plan(plans);
  for (int k = 0; k < steps; ++k) {
    for (const step_plan::entry& e : plans[static_cast<std::size_t>(k)].entries()) {
      const unit_view v = rt.acquire(e.unit, compute);
      ASSERT_TRUE(v.tensors[0].state);
      expect_error_mentioning<invalid_argument>([&] { (void)v.grad(0); }, "state tensor");
      const tensor_view running = v.param_tensor(0);
      write_gradients(v, me, static_cast<std::uint64_t>(k), compute);  // also the state tensors' (ignored) elements
      launch_host_func(compute, [running, me, k] {
        for (std::size_t i = 0; i < running.count; ++i) {
          detail::narrow_element(running.memory.data(), running.type, i,
                                 static_cast<float>(100 * me + 10 * k) + static_cast<float>(i));
        }
      });
      rt.grads_ready(e.unit, compute);
      rt.step(e.unit, compute);
      rt.release(e.unit, compute);
    }
    (void)rt.end_step();
  }
  rt.flush();
  for (std::uint32_t u = 0; u < 3; ++u) {
    const home_view h = rt.home(unit_id{u});
    const tensor_info& running = h.tensors[0];
    const float from = u == 2 ? 100.0F : 0.0F;  // c: rank 1's
    for (std::size_t i = 0; i < running.count; ++i) {
      // rank 0 (1 for c) wrote 100 * rank + 10 * 2 + i in the last step; b in step 1 on rank 1 was rank 0's, too.
      EXPECT_EQ(detail::widen_element(h.params.data, h.params.type, running.offset + i),
                from + 20.0F + static_cast<float>(i))
        << "unit " << u << " element " << i << " rank " << me;
    }
    // The trainable part is equal on every rank.
    std::vector<float> master(static_cast<const float*>(h.master.data),
                              static_cast<const float*>(h.master.data) + h.master.count);
    std::vector<float> root = master;
    MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT_EQ(0, std::memcmp(root.data(), master.data(), root.size() * sizeof(float)))
      << "unit " << u << " rank " << me;
    EXPECT_EQ(h.step, steps);
  }
  // Only the trainable range is reduced.
  EXPECT_EQ(footprint(units[0], optimizer_placement::device).reduce_bytes, (64 + 4) * sizeof(float));  // w, its gap, b
}

// A streamed layer: acquired frozen for its forward (given back at release) and again, trained,
// for its backward. Its trained use ends its gradients, so a use after it is refused.
TEST(reducer_mpi, a_unit_is_used_frozen_then_trained_in_a_step_and_never_after_its_trained_use)
{
  const std::vector<unit_spec> units = model();
  const runtime_options opt = options_for({}, budget_for(units));
  runtime rt(make_device(opt.device), opt, units);
  step_plan streamed;
  streamed.acquire(unit_id{0}, unit_use::frozen).release(unit_id{0}).acquire(unit_id{0}).release(unit_id{0});
  EXPECT_NO_THROW(rt.plan(streamed));
  step_plan twice;
  twice.acquire(unit_id{0}).release(unit_id{0}).acquire(unit_id{0}, unit_use::frozen).release(unit_id{0});
  try {
    rt.plan(twice);
    FAIL() << "a plan that uses a unit after its trained use was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("after its trained use"), std::string::npos) << e.what();
  }
}

// Streamed layers trained on every rank, backward from the last: a layer's room comes back when
// its gradient bucket's reduction is launched. With a bucket a layer a budget of two layers holds
// the backward (a layer and the one below it, acquired before the first is released), skips
// given in any order included; with the layers in one bucket the plan check refuses that budget
// before the agreement, saying why.
TEST(reducer_mpi, a_released_layers_room_comes_back_when_its_bucket_is_launched)
{
  constexpr std::uint32_t layers = 6;
  std::vector<unit_spec> units;
  for (std::uint32_t i = 0; i < layers; ++i) {
    unit_spec u;
    u.name = "layer" + std::to_string(i);
    u.tensors = {{"w", {64, 64}}};
    u.compute = dtype::f32;
    u.policy = unit_policy{.residency = residency::prefetch, .lookahead = 1, .optimizer = optimizer_placement::device};
    units.push_back(std::move(u));
  }
  const unit_footprint fp = footprint(units[0], optimizer_placement::device);
  const auto backward = [&](std::uint32_t from) {  // layers from-1 .. 0
    step_plan p;
    for (std::uint32_t i = from; i-- > 0;) {
      p.acquire(unit_id{i});
      if (i + 1 < from) { p.release(unit_id{i + 1}); }
    }
    return p.release(unit_id{0});
  };
  run_options one_each;
  one_each.bucket_cap = fp.reduce_bytes;
  const runtime_options opt = options_for(one_each, 2 * fp.device_bytes);
  const device dev = make_device(opt.device);
  {
    runtime rt(dev, opt, units);
    stream compute(dev);
    for (std::uint64_t k = 0; k < 4; ++k) {
      // Rank 1 leaves the layers early in odd steps and skips the rest, lowest first: each is
      // held for the update rank 0 trains, and given back at its bucket's launch.
      const bool exits = world_rank() == 1 && k % 2 == 1;
      rt.plan(backward(layers));
      const std::uint32_t from = exits ? 3 : layers;
      if (exits) { rt.skip(std::vector<unit_id>{unit_id{3}, unit_id{4}, unit_id{5}}); }
      for (std::uint32_t i = from; i-- > 0;) {
        const unit_view v = rt.acquire(unit_id{i}, compute);
        write_gradients(v, world_rank(), k, compute);
        rt.step(unit_id{i}, compute);
        if (i + 1 < from) { rt.release(unit_id{i + 1}, compute); }
      }
      rt.release(unit_id{0}, compute);
      (void)rt.end_step();
    }
    rt.flush();
    EXPECT_LE(rt.stats().total.peak_device_bytes, 2 * fp.device_bytes);
    for (std::uint32_t i = 0; i < layers; ++i) { EXPECT_EQ(rt.stats().units[i].step, 4) << "layer " << i; }
  }
  run_options one_bucket;
  one_bucket.bucket_cap = layers * fp.reduce_bytes;
  const runtime_options together = options_for(one_bucket, 2 * fp.device_bytes);
  runtime rt(dev, together, units);
  expect_error_mentioning<config_error>([&] { rt.plan(backward(layers)); },
                                        "counts until its gradient bucket's reduction is launched");
}

TEST(reducer_mpi, mismatched_registrations_are_refused_on_every_rank)
{
  std::vector<unit_spec> units = model(world_rank() == 1 ? 24 : 16);  // rank 1's heads are larger
  runtime_options opt = options_for({}, std::size_t{8} << 20);
  try {
    runtime rt(make_device(opt.device), opt, units);
    FAIL() << "the runtime started although rank 1 registered different units";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("registered different units"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
}

// Every rank initialises differently (rank k adds k to unit 3's master and sets its moments), as a
// trainer with a per-rank seed would.
void init_home_differently(runtime& rt)
{
  init_home(rt);
  const home_view h = rt.home(unit_id{3});
  auto* master = static_cast<float*>(h.master.data);
  auto* m = static_cast<float*>(h.m.data);
  for (std::size_t i = 0; i < h.master.count; ++i) {
    master[i] += static_cast<float>(world_rank());
    m[i] = 0.5F * static_cast<float>(world_rank());
  }
}

TEST(reducer_mpi, initial_broadcast_makes_every_replica_rank_0s_at_the_first_plan)
{
  const std::vector<unit_spec> units = model();
  const runtime_options opt = options_for({}, budget_for(units));
  runtime rt(make_device(opt.device), opt, units);
  init_home_differently(rt);
  std::vector<home_state> rank0;
  {  // rank 0's values, as every rank can compute them
    runtime_options local = opt;
    local.comm.backend = comm_backend::none;
    runtime probe(make_device(local.device), local, units);
    init_home(probe);
    for (std::uint32_t u = 0; u < probe.unit_count(); ++u) { rank0.push_back(read_home(probe, unit_id{u})); }
  }
  rt.plan(step_plan{unit_id{0}, unit_id{1}});  // the first plan broadcasts
  stream compute(rt.get_device());
  for (const std::uint32_t u : {0U, 1U}) { (void)rt.acquire(unit_id{u}, compute); }
  for (const std::uint32_t u : {1U, 0U}) { rt.release(unit_id{u}, compute); }  // trained on zeros
  (void)rt.end_step();
  rt.flush();
  for (std::uint32_t u = 2; u < rt.unit_count(); ++u) {  // untouched by the step: rank 0's bits
    const home_state h = read_home(rt, unit_id{u});
    EXPECT_EQ(0, std::memcmp(h.master.data(), rank0[u].master.data(), h.master.size() * 4))
      << "rank " << world_rank() << " unit " << u;
    EXPECT_EQ(0, std::memcmp(h.m.data(), rank0[u].m.data(), h.m.size() * 4))
      << "rank " << world_rank() << " unit " << u;
  }
  rt.save_checkpoint(std::filesystem::temp_directory_path() /
                     ("taskswap_initial_broadcast_np" + std::to_string(world_size())));  // its replica check passes
}

TEST(reducer_mpi, initial_verify_names_the_units_and_ranks_that_differ_and_accepts_equal_replicas)
{
  const std::vector<unit_spec> units = model();
  runtime_options opt = options_for({}, budget_for(units));
  opt.comm.initial = initial_sync::verify;
  runtime rt(make_device(opt.device), opt, units);
  init_home_differently(rt);
  if (world_size() > 1) {
    std::string ranks;
    for (int k = 1; k < world_size(); ++k) { ranks += (k > 1 ? ", " : "") + std::to_string(k); }
    try {
      rt.plan(step_plan{unit_id{0}, unit_id{1}});
      FAIL() << "replicas that start different were trained";
    } catch (const config_error& e) {
      const std::string text = e.what();
      EXPECT_NE(text.find("1 unit(s) start different from rank 0's: 'head1' on rank(s) " + ranks), std::string::npos)
        << text;
      EXPECT_NE(text.find("initial = \"broadcast\""), std::string::npos) << text;
    }
  }
  init_home(rt);  // the same on every rank now: the next plan goes through
  const home_view h = rt.home(unit_id{3});
  std::memset(h.m.data, 0, h.m.count * 4);
  // A master written after the refused plan is the one the bf16 parameters are derived from.
  const home_view t1 = rt.home(unit_id{1});
  std::fill_n(static_cast<float*>(t1.master.data), t1.master.count, 0.25F);
  rt.plan(step_plan{unit_id{0}, unit_id{1}});
  const home_view derived = rt.home(unit_id{1});
  const auto* bf16 = static_cast<const std::uint16_t*>(derived.params.data);
  EXPECT_TRUE(std::all_of(bf16, bf16 + derived.params.count, [](std::uint16_t b) { return b == 0x3E80; }))
    << "rank " << world_rank() << ": bf16 params not derived from the master written after the refusal";
  stream compute(rt.get_device());
  for (const std::uint32_t u : {0U, 1U}) { (void)rt.acquire(unit_id{u}, compute); }
  for (const std::uint32_t u : {1U, 0U}) { rt.release(unit_id{u}, compute); }
  (void)rt.end_step();
  rt.flush();
}

TEST(communicator_mpi, broadcast_copies_the_roots_bytes_and_refuses_a_bad_root)
{
  const device dev = emulated_device({.memory_bytes = 1 << 20});
  const auto comm = make_mpi_communicator(dev, test_timeout);
  stream s(dev);
  device_buffer buf(dev, 1000);
  const int root = world_size() - 1;
  launch_host_func(s, [&] { std::memset(buf.data(), comm->rank() + 1, 1000); });
  comm->broadcast(buf.span(0, 999), root, s, "bytes");
  s.synchronize();
  const std::byte* b = buf.data();
  EXPECT_EQ(std::to_integer<int>(b[0]), root + 1);
  EXPECT_EQ(std::to_integer<int>(b[998]), root + 1);
  EXPECT_EQ(std::to_integer<int>(b[999]), comm->rank() + 1);  // past the span: untouched
  expect_error_mentioning<invalid_argument>([&] { comm->broadcast(buf.span(0, 8), world_size(), s, "x"); },
                                            "is not a rank of");
}

TEST(communicator_mpi, allreduce_ops_and_counts)
{
  const device dev = emulated_device({.memory_bytes = 1 << 20});
  const auto comm = make_mpi_communicator(dev, test_timeout);
  ASSERT_EQ(comm->size(), world_size());
  stream s(dev);
  device_buffer buf(dev, 64 * sizeof(float));
  const auto fill = [&](dtype t) {
    launch_host_func(s, [&, t] {
      for (std::size_t i = 0; i < 64; ++i) {
        detail::narrow_element(buf.data(), t, i, static_cast<float>(comm->rank() + 1) * static_cast<float>(i % 4));
      }
    });
  };
  const float n = static_cast<float>(world_size());
  const float rank_sum = n * (n + 1) / 2;
  for (const dtype t : {dtype::f32, dtype::bf16, dtype::f16}) {
    const device_span span = buf.span(0, 64 * size_of(t));
    fill(t);
    comm->allreduce(span, t, reduce_op::sum, 1.0, s, "sum");
    s.synchronize();
    EXPECT_EQ(detail::widen_element(buf.data(), t, 3), rank_sum * 3) << to_string(t);
    fill(t);
    comm->allreduce(span, t, reduce_op::premul_sum, 0.5, s, "premul");
    s.synchronize();
    EXPECT_EQ(detail::widen_element(buf.data(), t, 2), rank_sum) << to_string(t);
    fill(t);
    comm->allreduce(span, t, reduce_op::average, 1.0, s, "average");
    s.synchronize();
    EXPECT_NEAR(detail::widen_element(buf.data(), t, 1), rank_sum / n, 1e-2) << to_string(t);
  }
  std::vector<std::int64_t> counts(5, comm->rank());
  comm->allreduce_counts(counts, s, "counts");
  comm->barrier(s);
  const auto channel = comm->split();
  channel->barrier(s);
  s.synchronize();
  EXPECT_EQ(counts[4], static_cast<std::int64_t>(world_size()) * (world_size() - 1) / 2);
  EXPECT_THROW(comm->allreduce(buf.span(0, 6), dtype::f32, reduce_op::sum, 1.0, s, "odd"), invalid_argument);
}

}  // namespace
}  // namespace taskswap::test
