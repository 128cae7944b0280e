// SPDX-License-Identifier: Apache-2.0
// The NCCL communicator at world size 1 on a CUDA device (label gpu): the ops, the split channel,
// the runtime reducing through it, and a streamed trunk's trained layers reduced through it.
// Multi-GPU runs need more than one GPU, which the test machines do not have.

#include "cuda_skip.hpp"
#include "numeric/dtype_conversion.hpp"

#include <taskswap/comm.hpp>
#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace taskswap::test {
namespace {

constexpr std::chrono::milliseconds timeout{30'000};

std::string nccl_skip_reason()
{
  std::string reason = cuda_skip_reason();
  if (reason.empty() && !get_build_info().nccl) { reason = "taskswap was built without NCCL"; }
  return reason;
}

TEST(nccl, ops_at_world_size_one)
{
  if (const std::string r = nccl_skip_reason(); !r.empty()) { GTEST_SKIP() << r; }
  const device dev = cuda_device(0);
  const auto comm = make_nccl_communicator(dev, make_nccl_unique_id(), 0, 1, timeout);
  ASSERT_EQ(comm->size(), 1);
  stream s(dev);
  constexpr std::size_t n = 1000;
  device_buffer buf(dev, n * sizeof(float));
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) { host[i] = static_cast<float>(i % 13) - 6.0F; }
  for (const dtype t : {dtype::f32, dtype::bf16, dtype::f16}) {
    std::vector<std::byte> in(n * size_of(t));
    for (std::size_t i = 0; i < n; ++i) { detail::narrow_element(in.data(), t, i, host[i]); }
    copy_async(buf.span(0, in.size()), in, s);
    comm->allreduce(buf.span(0, in.size()), t, reduce_op::sum, 1.0, s, "sum");
    comm->allreduce(buf.span(0, in.size()), t, reduce_op::premul_sum, 0.5, s, "premul");
    comm->allreduce(buf.span(0, in.size()), t, reduce_op::average, 1.0, s, "average");
    std::vector<std::byte> out(in.size());
    copy_async(out, const_device_span(buf.span(0, in.size())), s);
    s.synchronize();
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(detail::widen_element(out.data(), t, i), host[i] * 0.5F) << to_string(t) << " element " << i;
    }
  }
  std::vector<std::int64_t> counts{3, -4, 5};
  comm->allreduce_counts(counts, s, "counts");
  comm->barrier(s);
  const auto channel = comm->split();
  channel->barrier(s);
  s.synchronize();
  EXPECT_EQ(counts, (std::vector<std::int64_t>{3, -4, 5}));
  comm->check();
}

TEST(nccl, runtime_reduces_only_active_units)
{
  if (const std::string r = nccl_skip_reason(); !r.empty()) { GTEST_SKIP() << r; }
  const device dev = cuda_device(0);
  std::vector<unit_spec> units;
  for (const char* name : {"trunk", "head0", "head1", "head2"}) {
    units.push_back(
      unit_spec{.name = name, .tensors = {{"w", {256, 64}}}, .compute = dtype::bf16, .grad = {}, .policy = {}});
  }
  runtime_options o;
  o.device.budget = std::size_t{8} << 20;
  runtime rt(dev, o, units, make_nccl_communicator(dev, make_nccl_unique_id(), 0, 1, timeout));
  stream compute(dev);
  rt.plan(std::vector<step_plan>{step_plan{unit_id{0}, unit_id{1}}, step_plan{unit_id{0}, unit_id{2}}});
  for (const std::uint32_t head : {1U, 2U}) {
    for (const unit_id u : {unit_id{0}, unit_id{head}}) { (void)rt.acquire(u, compute); }
    for (const unit_id u : {unit_id{head}, unit_id{0}}) {
      rt.grads_ready(u, compute);
      rt.step(u, compute);
      rt.release(u, compute);
    }
    const step_stats st = rt.end_step();
    EXPECT_EQ(st.reduced_bytes, 2 * 256 * 64 * size_of(dtype::bf16));
    EXPECT_EQ(st.reduce_all_bytes, 4 * 256 * 64 * size_of(dtype::bf16));
  }
  rt.flush();
  EXPECT_EQ(rt.home(unit_id{3}).step, 0);
  EXPECT_EQ(rt.home(unit_id{0}).step, 2);
}

// A trunk streamed through a budget of the task unit and two layers, its layers trained with a
// bucket a layer: each layer's reduction is launched at its grads_ready, and its room comes back at
// that launch. Each layer's gradients arrive behind 2 ms of "compute" on the trainer's stream, so
// when the host calls step() the reduction cannot have run: step() takes the update-on-aux path
// (after the reduction, while the trainer's stream goes on), every time. At world size 1 the sum
// is the identity, so the run must equal one without a communicator bit for bit.
TEST(nccl, streamed_trained_layers_reduced_as_they_complete_equal_a_run_without_communicator)
{
  if (const std::string r = nccl_skip_reason(); !r.empty()) { GTEST_SKIP() << r; }
  const device dev = cuda_device(0);
  constexpr std::uint32_t layers = 8;
  constexpr int steps = 4;
  std::vector<unit_spec> units;
  for (std::uint32_t i = 0; i <= layers; ++i) {
    units.push_back(unit_spec{
      .name = i == 0 ? std::string("task") : "layer/" + std::to_string(i - 1),
      .tensors = {{"w", {512, 512}}},
      .compute = dtype::f32,
      .grad = {},
      .policy =
        unit_policy{.residency = residency::prefetch, .lookahead = 1, .optimizer = optimizer_placement::device}});
  }
  const auto layer = [](std::uint32_t l) { return unit_id{1 + l}; };
  step_plan plan_step;
  plan_step.acquire(unit_id{0});
  for (std::uint32_t l = 0; l < layers; ++l) { plan_step.acquire(layer(l), unit_use::frozen).release(layer(l)); }
  for (std::uint32_t l = layers; l-- > 0;) { plan_step.acquire(layer(l)).release(layer(l)); }
  plan_step.release(unit_id{0});
  const unit_footprint fp = footprint(units[1], optimizer_placement::device);  // every unit's
  const std::size_t granule = dev.granularity();
  const std::size_t room = (fp.device_bytes + granule - 1) / granule * granule;

  // Every gradient of both runs, made once: unit u's at step k is slice k * (layers + 1) + u.
  const std::size_t count = std::size_t{512} * 512;
  pinned_buffer gradients(dev, std::size_t{steps} * (layers + 1) * count * sizeof(float));
  {
    std::vector<float> x(std::size_t{steps} * (layers + 1) * count);
    for (std::size_t j = 0; j < x.size(); ++j) {
      const std::size_t i = j % count;
      const std::size_t u = j / count % (layers + 1);
      const std::size_t k = j / count / (layers + 1);
      x[j] = 0.001F * static_cast<float>((i * 7 + u * 13 + k * 5) % 23) - 0.011F;
    }
    std::memcpy(gradients.data(), x.data(), x.size() * sizeof(float));
  }
  struct outcome {
    std::vector<std::vector<float>> params, m, v;
    std::size_t reduced = 0;
  };
  const auto train = [&](bool with_nccl) {
    runtime_options o;
    o.device.budget = 3 * room;
    o.comm.bucket_cap = fp.reduce_bytes;
    o.optimizer.lr = 1e-2F;
    o.optimizer.weight_decay = 0.1F;
    runtime rt = with_nccl ? runtime(dev, o, units, make_nccl_communicator(dev, make_nccl_unique_id(), 0, 1, timeout))
                           : runtime(dev, o, units);
    for (std::uint32_t u = 0; u <= layers; ++u) {
      const home_view h = rt.home(unit_id{u});
      auto* w = static_cast<float*>(h.master.data);
      for (std::size_t i = 0; i < h.master.count; ++i) { w[i] = 0.01F * static_cast<float>((i + u) % 17) - 0.05F; }
    }
    rt.plan(std::vector<step_plan>(steps, plan_step));
    stream compute(dev);
    outcome out;
    // u's backward at step k: 2 ms of compute, its gradients, then grads_ready, step and release.
    const auto backward = [&](unit_id u, const unit_view& view, int k) {
      const slab_view g = view.grads;
      launch_host_func(compute, [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); });
      const std::size_t slice = (static_cast<std::size_t>(k) * (layers + 1) + u.value) * g.bytes();
      copy_async(device_span(&dev.backend(), static_cast<std::byte*>(g.data), g.bytes()),
                 std::span<const std::byte>(gradients.data() + slice, g.bytes()), compute);
      rt.grads_ready(u, compute);
      rt.step(u, compute);
      rt.release(u, compute);
    };
    for (int k = 0; k < steps; ++k) {
      const unit_view task = rt.acquire(unit_id{0}, compute);
      for (std::uint32_t l = 0; l < layers; ++l) {
        (void)rt.acquire(layer(l), compute, unit_use::frozen);
        rt.release(layer(l), compute);
      }
      for (std::uint32_t l = layers; l-- > 0;) { backward(layer(l), rt.acquire(layer(l), compute), k); }
      backward(unit_id{0}, task, k);
      out.reduced += rt.end_step().reduced_bytes;
    }
    rt.flush();
    compute.synchronize();
    const auto copy = [](const slab_view& s) {
      std::vector<float> c(s.count);
      std::memcpy(c.data(), s.data, s.bytes());
      return c;
    };
    for (std::uint32_t u = 0; u <= layers; ++u) {
      const home_view h = rt.home(unit_id{u});
      EXPECT_EQ(h.step, steps) << "unit " << u;
      out.params.push_back(copy(h.master));
      out.m.push_back(copy(h.m));
      out.v.push_back(copy(h.v));
    }
    return out;
  };
  const outcome alone = train(false);
  const outcome reduced = train(true);
  EXPECT_EQ(alone.reduced, 0U);
  EXPECT_EQ(reduced.reduced, std::size_t{steps} * (layers + 1) * fp.reduce_bytes);
  for (std::uint32_t u = 0; u <= layers; ++u) {
    EXPECT_TRUE(alone.params[u] == reduced.params[u]) << "unit " << u << ": parameters differ";
    EXPECT_TRUE(alone.m[u] == reduced.m[u] && alone.v[u] == reduced.v[u]) << "unit " << u << ": AdamW state differs";
  }
}

}  // namespace
}  // namespace taskswap::test
