// SPDX-License-Identifier: Apache-2.0
#include "kernels/kernels.hpp"

#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"
#include "host/cpu_adamw.hpp"
#include "kernels/cuda_kernels.hpp"
#include "numeric/dtype_conversion.hpp"
#include "numeric/rounding.hpp"

#include <cstdint>
#include <cstring>

namespace taskswap::detail {

namespace {

void expect_aligned(const void* p, dtype type, const char* what)
{
  const auto address = reinterpret_cast<std::uintptr_t>(p);  // NOLINT: alignment check
  TASKSWAP_EXPECTS(p != nullptr, message(what, ": null pointer"));
  TASKSWAP_EXPECTS(address % size_of(type) == 0,
                   message(what, ": ", to_string(type), " slab at ", p, " is not ", size_of(type),
                           "-byte aligned"));
}

bool on_cuda(stream_view s) { return s.backend().kind() == backend_kind::cuda; }

}  // namespace

void host_unscale_and_check(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite)
{
  bool nonfinite = false;
  for (std::size_t i = 0; i < count; ++i) {
    const float y = mul_rn(widen_element(grad, type, i), factor);
    nonfinite = nonfinite || !(y - y == 0.0F);  // false for inf and NaN
    narrow_element(grad, type, i, y);
  }
  if (nonfinite) { *found_nonfinite = 1; }
}

void host_cast(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count)
{
  for (std::size_t i = 0; i < count; ++i) { narrow_element(dst, dst_type, i, widen_element(src, src_type, i)); }
}

void host_fill(void* dst, dtype type, std::size_t count, float value)
{
  if (type == dtype::f32) {
    const float v = canonical(value);
    for (std::size_t i = 0; i < count; ++i) { static_cast<float*>(dst)[i] = v; }
    return;
  }
  const std::uint16_t bits = type == dtype::bf16 ? float_to_bf16(value) : float_to_f16(value);
  for (std::size_t i = 0; i < count; ++i) { static_cast<std::uint16_t*>(dst)[i] = bits; }
}

void adamw_async(const adamw_slabs& slabs, const adamw_scalars& scalars, stream_view s)
{
  if (slabs.count == 0) { return; }
  expect_aligned(slabs.master, dtype::f32, "adamw master");
  expect_aligned(slabs.m, dtype::f32, "adamw m");
  expect_aligned(slabs.v, dtype::f32, "adamw v");
  expect_aligned(slabs.grad, slabs.grad_type, "adamw gradient");
  TASKSWAP_EXPECTS(slabs.params == nullptr || slabs.param_type != dtype::f32,
                   "AdamW: an f32 compute dtype updates the master in place; pass no params copy");
  if (slabs.params != nullptr) { expect_aligned(slabs.params, slabs.param_type, "adamw params"); }
  if (on_cuda(s)) {
    launch_adamw(slabs, scalars, s.backend().index(), s.native_handle());
    return;
  }
  // The emulated device's "kernel": the CPU path on the stream's worker, in stream order.
  s.backend().launch_host_func(s.native_handle(), [slabs, scalars] {
    cpu_adamw_range(slabs, scalars, 0, slabs.count, best_cpu_isa());
  });
}

void unscale_and_check_async(void* grad, dtype type, std::size_t count, float factor,
                             int* found_nonfinite, stream_view s)
{
  if (count == 0) { return; }
  expect_aligned(grad, type, "unscale gradient");
  expect_aligned(found_nonfinite, dtype::f32, "unscale found_nonfinite flag");
  if (on_cuda(s)) {
    launch_unscale_and_check(grad, type, count, factor, found_nonfinite, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [=] {
    host_unscale_and_check(grad, type, count, factor, found_nonfinite);
  });
}

void cast_async(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count, stream_view s)
{
  if (count == 0) { return; }
  expect_aligned(dst, dst_type, "cast destination");
  expect_aligned(src, src_type, "cast source");
  if (on_cuda(s)) {
    launch_cast(dst, dst_type, src, src_type, count, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [=] { host_cast(dst, dst_type, src, src_type, count); });
}

void fill_async(void* dst, dtype type, std::size_t count, float value, stream_view s)
{
  if (count == 0) { return; }
  expect_aligned(dst, type, "fill destination");
  if (on_cuda(s)) {
    launch_fill(dst, type, count, value, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [=] { host_fill(dst, type, count, value); });
}

}  // namespace taskswap::detail
