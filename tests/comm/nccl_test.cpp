// SPDX-License-Identifier: Apache-2.0
// The NCCL communicator at world size 1 on a CUDA device (label gpu): the ops, the split channel,
// and the runtime reducing through it. Multi-GPU runs are not possible on the machines lent here.

#include "cuda_skip.hpp"
#include "numeric/dtype_conversion.hpp"

#include <taskswap/comm.hpp>
#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace taskswap::test
