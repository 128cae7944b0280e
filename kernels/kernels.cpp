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
#include <vector>

namespace taskswap::detail {

namespace {

void expect_aligned(const void* p, dtype type, const char* what)
{
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): alignment check
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  TASKSWAP_EXPECTS(p != nullptr, message(what, ": null pointer"));
  TASKSWAP_EXPECTS(is_floating(type), message(what, ": u8 is raw bytes (a frozen unit's), never computed on"));
  TASKSWAP_EXPECTS(address % size_of(type) == 0,
                   message(what, ": ", to_string(type), " slab at ", p, " is not ", size_of(type), "-byte aligned"));
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

namespace {

// Lane j of [0, n) adds element base + j: each lane's adds stay in element order. One dtype per
// instantiation, so the loop vectorizes (lanes are independent; a float's square is exact in
// double, so the vector width changes no bit).
template <dtype G>
__attribute__((always_inline)) inline void lanes_body(const void* grad, std::size_t base, std::size_t n, float unscale,
                                                      double* lanes)
{
  for (std::size_t j = 0; j < n; ++j) {
    float g = 0;
    if constexpr (G == dtype::f32) {
      g = static_cast<const float*>(grad)[base + j];
    } else if constexpr (G == dtype::bf16) {
      g = bf16_to_float(static_cast<const std::uint16_t*>(grad)[base + j]);
    } else {
      g = f16_to_float(static_cast<const std::uint16_t*>(grad)[base + j]);
    }
    lanes[j] = dadd_rn(lanes[j], unscaled_square(g, unscale));
  }
}

// The same loop compiled for wider vectors, chosen at run time as the CPU AdamW chooses its path
// (not target_clones: its ifunc resolvers run before a sanitizer's runtime is up).
template <dtype G>
__attribute__((target("avx512f"))) void add_to_lanes_avx512(const void* grad, std::size_t base, std::size_t n,
                                                            float unscale, double* lanes)
{
  lanes_body<G>(grad, base, n, unscale, lanes);
}

template <dtype G>
__attribute__((target("avx2"))) void add_to_lanes_avx2(const void* grad, std::size_t base, std::size_t n, float unscale,
                                                       double* lanes)
{
  lanes_body<G>(grad, base, n, unscale, lanes);
}

template <dtype G>
void add_to_lanes(const void* grad, std::size_t base, std::size_t n, float unscale, double* lanes)
{
  static const cpu_isa isa = best_cpu_isa();
  switch (isa) {
    case cpu_isa::avx512: add_to_lanes_avx512<G>(grad, base, n, unscale, lanes); return;
    case cpu_isa::avx2: add_to_lanes_avx2<G>(grad, base, n, unscale, lanes); return;
    case cpu_isa::portable: break;
  }
  lanes_body<G>(grad, base, n, unscale, lanes);
}

}  // namespace

void host_square_sum(const void* grad, dtype type, std::size_t count, step_guard& g)
{
  // Lane j takes the elements j, j + lanes, ... in order, as the CUDA kernel's thread j does.
  thread_local std::vector<double> scratch(square_sum_lanes);
  double* lanes = scratch.data();
  const float unscale = inverse_scale(g.scale);
  for (std::size_t j = 0; j < square_sum_lanes; ++j) { lanes[j] = 0; }
  for (std::size_t base = 0; base < count; base += square_sum_lanes) {
    const std::size_t n = count - base < square_sum_lanes ? count - base : square_sum_lanes;
    switch (type) {
      case dtype::f32: add_to_lanes<dtype::f32>(grad, base, n, unscale, lanes); break;
      case dtype::bf16: add_to_lanes<dtype::bf16>(grad, base, n, unscale, lanes); break;
      case dtype::f16: add_to_lanes<dtype::f16>(grad, base, n, unscale, lanes); break;
      case dtype::u8: break;  // refused by expect_aligned
    }
  }
  // Each block's threads by a tree, then the blocks' sums by the same tree.
  double blocks[square_sum_blocks];
  for (unsigned b = 0; b < square_sum_blocks; ++b) {
    double* lane = lanes + std::size_t{b} * square_sum_threads;
    for (unsigned stride = square_sum_threads / 2; stride > 0; stride /= 2) {
      for (unsigned t = 0; t < stride; ++t) { lane[t] = dadd_rn(lane[t], lane[t + stride]); }
    }
    blocks[b] = lane[0];
  }
  for (unsigned stride = square_sum_blocks / 2; stride > 0; stride /= 2) {
    for (unsigned t = 0; t < stride; ++t) { blocks[t] = dadd_rn(blocks[t], blocks[t + stride]); }
  }
  g.square_sum = dadd_rn(g.square_sum, blocks[0]);
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
  s.backend().launch_host_func(s.native_handle(),
                               [slabs, scalars] { cpu_adamw_range(slabs, scalars, 0, slabs.count, best_cpu_isa()); });
}

void adamw_async(const adamw_slabs& slabs, const adamw_scalars* scalars, const step_guard* guard, stream_view s)
{
  if (slabs.count == 0) { return; }
  expect_aligned(slabs.master, dtype::f32, "adamw master");
  expect_aligned(slabs.m, dtype::f32, "adamw m");
  expect_aligned(slabs.v, dtype::f32, "adamw v");
  expect_aligned(slabs.grad, slabs.grad_type, "adamw gradient");
  expect_aligned(scalars, dtype::f32, "adamw scalars");
  expect_aligned(guard, dtype::f32, "step guard");
  if (slabs.params != nullptr) { expect_aligned(slabs.params, slabs.param_type, "adamw params"); }
  if (on_cuda(s)) {
    launch_adamw_guarded(slabs, scalars, guard, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [slabs, scalars, guard] {
    if (guard->skip != 0) { return; }
    cpu_adamw_range(slabs, *scalars, 0, slabs.count, best_cpu_isa());
  });
}

void square_sum_async(const void* grad, dtype type, std::size_t count, step_guard* guard, double* lanes, stream_view s)
{
  expect_aligned(grad, type, "square sum gradient");
  expect_aligned(guard, dtype::f32, "step guard");
  if (on_cuda(s)) {
    launch_square_sum(grad, type, count, guard, lanes, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [=] { host_square_sum(grad, type, count, *guard); });
}

void finish_guard_async(step_guard* guard, const guard_settings& settings, stream_view s)
{
  expect_aligned(guard, dtype::f32, "step guard");
  if (on_cuda(s)) {
    launch_finish_guard(guard, settings, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [=] { finish_step_guard(*guard, settings); });
}

void prepare_guarded_async(const adamw_options& decay, const adamw_options& plain, std::int64_t* step,
                           const step_guard* guard, adamw_scalars* out, stream_view s)
{
  expect_aligned(out, dtype::f32, "adamw scalars");
  expect_aligned(guard, dtype::f32, "step guard");
  if (on_cuda(s)) {
    launch_prepare_guarded(decay, plain, step, guard, out, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(), [=] { prepare_guarded_scalars(decay, plain, *step, *guard, out); });
}

void unscale_and_check_async(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite,
                             stream_view s)
{
  if (count == 0) { return; }
  expect_aligned(grad, type, "unscale gradient");
  expect_aligned(found_nonfinite, dtype::f32, "unscale found_nonfinite flag");
  if (on_cuda(s)) {
    launch_unscale_and_check(grad, type, count, factor, found_nonfinite, s.backend().index(), s.native_handle());
    return;
  }
  s.backend().launch_host_func(s.native_handle(),
                               [=] { host_unscale_and_check(grad, type, count, factor, found_nonfinite); });
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
