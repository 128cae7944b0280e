// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels. Each element goes through the same float operations as the CPU path
// (host/adamw_formula.hpp, with __fmaf_rn/__fmul_rn/__fdiv_rn/__fsqrt_rn on the device), so the
// results are bitwise equal. Grid-stride loops; grids sized from the SM count and the kernel's
// occupancy.

#include "kernels/cuda_kernels.hpp"
#include "numeric/dtype_conversion.hpp"
#include "numeric/rounding.hpp"

#include "device/cuda/cuda_device_guard.hpp"
#include "device/cuda/cuda_try.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace taskswap::detail {
namespace {

constexpr int threads_per_block = 256;
constexpr std::size_t lanes = 4;  // elements per vector group: one 16-byte access per fp32 slab

enum class copy_kind { none, bf16, f16 };

__device__ inline std::size_t first_index() { return std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; }
__device__ inline std::size_t grid_stride() { return std::size_t{gridDim.x} * blockDim.x; }

template <dtype G>
__device__ inline float widen16(std::uint32_t bits)
{
  const auto h = static_cast<std::uint16_t>(bits);
  return G == dtype::bf16 ? bf16_to_float(h) : f16_to_float(h);
}

// Four gradients at i: one 16-byte load for fp32, one 8-byte load for 16-bit types.
template <dtype G>
__device__ inline float4 grads4(const void* g, std::size_t i)
{
  if constexpr (G == dtype::f32) {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(g) + i);
  } else {
    const uint2 x = *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(g) + i);
    return {widen16<G>(x.x & 0xFFFFU), widen16<G>(x.x >> 16U), widen16<G>(x.y & 0xFFFFU), widen16<G>(x.y >> 16U)};
  }
}

template <copy_kind P>
__device__ inline std::uint32_t narrow16(float x)
{
  return P == copy_kind::bf16 ? float_to_bf16(x) : float_to_f16(x);
}

template <copy_kind P>
__device__ inline void store_copy(void* params, std::size_t i, float p)
{
  if constexpr (P != copy_kind::none) {
    static_cast<std::uint16_t*>(params)[i] = static_cast<std::uint16_t>(narrow16<P>(p));
  }
}

template <copy_kind P>
__device__ inline void store_copy4(void* params, std::size_t i, float4 p)
{
  if constexpr (P != copy_kind::none) {
    const uint2 packed{narrow16<P>(p.x) | (narrow16<P>(p.y) << 16U), narrow16<P>(p.z) | (narrow16<P>(p.w) << 16U)};
    *reinterpret_cast<uint2*>(static_cast<std::uint16_t*>(params) + i) = packed;
  }
}

// Elements [0, head) and [head + groups * lanes, count) one at a time; the groups in between
// four at a time with vector accesses (the host checked every slab's alignment at head).
// Guarded: the scalars come from device memory, and a skipped step changes nothing.
template <dtype G, copy_kind P, bool Guarded>
__global__ void __launch_bounds__(threads_per_block)
  adamw_kernel(adamw_slabs s, adamw_scalars k, const adamw_scalars* device_k, const step_guard* guard, std::size_t head,
               std::size_t groups)
{
  if constexpr (Guarded) {
    if (guard->skip != 0) { return; }
    k = *device_k;
  }
  const std::size_t stride = grid_stride();
  for (std::size_t group = first_index(); group < groups; group += stride) {
    const std::size_t i = head + group * lanes;
    float4 m = *reinterpret_cast<const float4*>(s.m + i);
    float4 v = *reinterpret_cast<const float4*>(s.v + i);
    float4 p = *reinterpret_cast<const float4*>(s.master + i);
    const float4 g = grads4<G>(s.grad, i);
    adamw_element(g.x, p.x, m.x, v.x, k);
    adamw_element(g.y, p.y, m.y, v.y, k);
    adamw_element(g.z, p.z, m.z, v.z, k);
    adamw_element(g.w, p.w, m.w, v.w, k);
    *reinterpret_cast<float4*>(s.m + i) = m;
    *reinterpret_cast<float4*>(s.v + i) = v;
    *reinterpret_cast<float4*>(s.master + i) = p;
    store_copy4<P>(s.params, i, p);
  }
  const std::size_t tail = head + groups * lanes;
  const std::size_t singles = head + (s.count - tail);
  for (std::size_t j = first_index(); j < singles; j += stride) {
    const std::size_t i = j < head ? j : tail + (j - head);
    adamw_element(widen_element(s.grad, G, i), s.master[i], s.m[i], s.v[i], k);
    store_copy<P>(s.params, i, s.master[i]);
  }
}

// Thread j of the fixed grid (square_sum_blocks x square_sum_threads) adds the elements j,
// j + lanes, ... in order; four loads are issued before their adds, which keep that order.
__global__ void __launch_bounds__(square_sum_threads)
  square_sum_kernel(const void* grad, dtype type, std::size_t count, const step_guard* guard, double* block_sums)
{
  __shared__ double lane[square_sum_threads];
  const float unscale = inverse_scale(guard->scale);
  const std::size_t step = square_sum_lanes;
  double acc = 0;
  std::size_t i = std::size_t{blockIdx.x} * square_sum_threads + threadIdx.x;
  for (; i + 3 * step < count; i += 4 * step) {
    const float a = widen_element(grad, type, i);
    const float b = widen_element(grad, type, i + step);
    const float c = widen_element(grad, type, i + 2 * step);
    const float d = widen_element(grad, type, i + 3 * step);
    acc = dadd_rn(acc, unscaled_square(a, unscale));
    acc = dadd_rn(acc, unscaled_square(b, unscale));
    acc = dadd_rn(acc, unscaled_square(c, unscale));
    acc = dadd_rn(acc, unscaled_square(d, unscale));
  }
  for (; i < count; i += step) { acc = dadd_rn(acc, unscaled_square(widen_element(grad, type, i), unscale)); }
  lane[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned stride = square_sum_threads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) { lane[threadIdx.x] = dadd_rn(lane[threadIdx.x], lane[threadIdx.x + stride]); }
    __syncthreads();
  }
  if (threadIdx.x == 0) { block_sums[blockIdx.x] = lane[0]; }
}

// The blocks' sums by the same tree, added to the step's sum.
__global__ void __launch_bounds__(square_sum_blocks)
  square_sum_blocks_kernel(const double* block_sums, step_guard* guard)
{
  __shared__ double lane[square_sum_blocks];
  lane[threadIdx.x] = block_sums[threadIdx.x];
  __syncthreads();
  for (unsigned stride = square_sum_blocks / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) { lane[threadIdx.x] = dadd_rn(lane[threadIdx.x], lane[threadIdx.x + stride]); }
    __syncthreads();
  }
  if (threadIdx.x == 0) { guard->square_sum = dadd_rn(guard->square_sum, lane[0]); }
}

__global__ void finish_guard_kernel(step_guard* guard, guard_settings settings) { finish_step_guard(*guard, settings); }

__global__ void prepare_guarded_kernel(adamw_options decay, adamw_options plain, std::int64_t* step,
                                       const step_guard* guard, adamw_scalars* out)
{
  prepare_guarded_scalars(decay, plain, *step, *guard, out);
}

__global__ void __launch_bounds__(threads_per_block)
  unscale_kernel(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite)
{
  bool nonfinite = false;
  for (std::size_t i = first_index(); i < count; i += grid_stride()) {
    const float y = mul_rn(widen_element(grad, type, i), factor);
    nonfinite = nonfinite || !(y - y == 0.0F);  // false for inf and NaN
    narrow_element(grad, type, i, y);
  }
  if (nonfinite) { atomicOr(found_nonfinite, 1); }
}

__global__ void __launch_bounds__(threads_per_block)
  cast_kernel(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count)
{
  for (std::size_t i = first_index(); i < count; i += grid_stride()) {
    narrow_element(dst, dst_type, i, widen_element(src, src_type, i));
  }
}

__global__ void __launch_bounds__(threads_per_block)
  fill32_kernel(std::uint32_t* dst, std::size_t count, std::uint32_t bits)
{
  for (std::size_t i = first_index(); i < count; i += grid_stride()) { dst[i] = bits; }
}

__global__ void __launch_bounds__(threads_per_block)
  fill16_kernel(std::uint16_t* dst, std::size_t count, std::uint16_t bits)
{
  for (std::size_t i = first_index(); i < count; i += grid_stride()) { dst[i] = bits; }
}

// Resident blocks of `kernel` on the whole device: SMs x blocks per SM at its occupancy. Asked of
// the driver once per kernel and device, not on every launch.
template <typename Kernel>
std::size_t resident_blocks(Kernel kernel, int device_index)
{
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, std::size_t> known;
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device_index};
  const std::lock_guard lock(mutex);
  if (auto found = known.find(key); found != known.end()) { return found->second; }
  int sms = 0;
  int blocks_per_sm = 0;
  TASKSWAP_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_index));
  TASKSWAP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads_per_block, 0));
  const std::size_t blocks = static_cast<std::size_t>(sms) * static_cast<std::size_t>(std::max(blocks_per_sm, 1));
  known.emplace(key, blocks);
  return blocks;
}

// Enough blocks to fill every SM at the kernel's occupancy, fewer when there is less work.
template <typename Kernel>
unsigned grid_for(Kernel kernel, int device_index, std::size_t work_items)
{
  const std::size_t full = resident_blocks(kernel, device_index);
  const std::size_t needed = (work_items + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min(full, needed)));
}

bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

template <dtype G, copy_kind P, bool Guarded>
void launch_adamw_typed(const adamw_slabs& s, const adamw_scalars& k, const adamw_scalars* device_k,
                        const step_guard* guard, int device_index, cudaStream_t stream)
{
  // Elements before the master's first 16-byte boundary go one at a time; the vector part needs
  // every slab aligned at the same element.
  const auto master_address = reinterpret_cast<std::uintptr_t>(s.master);
  std::size_t head = std::min<std::size_t>(s.count, ((16 - master_address % 16) % 16) / 4);
  const std::size_t grad_bytes = G == dtype::f32 ? 4 : 2;
  const bool vectorizable = aligned(s.m + head, 16) && aligned(s.v + head, 16) &&
                            aligned(static_cast<const std::byte*>(s.grad) + head * grad_bytes, 4 * grad_bytes) &&
                            (P == copy_kind::none || aligned(static_cast<const std::byte*>(s.params) + head * 2, 8));
  std::size_t groups = 0;
  if (vectorizable) {
    groups = (s.count - head) / lanes;
  } else {
    head = s.count;
  }
  const std::size_t singles = s.count - groups * lanes;
  const unsigned blocks = grid_for(adamw_kernel<G, P, Guarded>, device_index, std::max(groups, singles));
  adamw_kernel<G, P, Guarded><<<blocks, threads_per_block, 0, stream>>>(s, k, device_k, guard, head, groups);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

template <dtype G, bool Guarded>
void launch_adamw_grad(const adamw_slabs& s, const adamw_scalars& k, const adamw_scalars* device_k,
                       const step_guard* guard, int device_index, cudaStream_t stream)
{
  if (s.params == nullptr) {
    launch_adamw_typed<G, copy_kind::none, Guarded>(s, k, device_k, guard, device_index, stream);
  } else if (s.param_type == dtype::bf16) {
    launch_adamw_typed<G, copy_kind::bf16, Guarded>(s, k, device_k, guard, device_index, stream);
  } else {
    launch_adamw_typed<G, copy_kind::f16, Guarded>(s, k, device_k, guard, device_index, stream);
  }
}

template <bool Guarded>
void launch_adamw_any(const adamw_slabs& slabs, const adamw_scalars& k, const adamw_scalars* device_k,
                      const step_guard* guard, int device_index, void* stream)
{
  const cuda_device_guard device(device_index);
  auto* s = static_cast<cudaStream_t>(stream);
  switch (slabs.grad_type) {
    case dtype::f32: launch_adamw_grad<dtype::f32, Guarded>(slabs, k, device_k, guard, device_index, s); return;
    case dtype::bf16: launch_adamw_grad<dtype::bf16, Guarded>(slabs, k, device_k, guard, device_index, s); return;
    case dtype::f16: launch_adamw_grad<dtype::f16, Guarded>(slabs, k, device_k, guard, device_index, s); return;
    case dtype::u8: return;  // refused by adamw_async
  }
}

}  // namespace

void launch_adamw(const adamw_slabs& slabs, const adamw_scalars& scalars, int device_index, void* stream)
{
  launch_adamw_any<false>(slabs, scalars, nullptr, nullptr, device_index, stream);
}

void launch_adamw_guarded(const adamw_slabs& slabs, const adamw_scalars* scalars, const step_guard* guard,
                          int device_index, void* stream)
{
  launch_adamw_any<true>(slabs, adamw_scalars{}, scalars, guard, device_index, stream);
}

void launch_square_sum(const void* grad, dtype type, std::size_t count, step_guard* guard, double* lanes,
                       int device_index, void* stream)
{
  const cuda_device_guard device(device_index);
  auto* s = static_cast<cudaStream_t>(stream);
  square_sum_kernel<<<square_sum_blocks, square_sum_threads, 0, s>>>(grad, type, count, guard, lanes);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
  square_sum_blocks_kernel<<<1, square_sum_blocks, 0, s>>>(lanes, guard);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

void launch_finish_guard(step_guard* guard, const guard_settings& settings, int device_index, void* stream)
{
  const cuda_device_guard device(device_index);
  finish_guard_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(guard, settings);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

void launch_prepare_guarded(const adamw_options& decay, const adamw_options& plain, std::int64_t* step,
                            const step_guard* guard, adamw_scalars* out, int device_index, void* stream)
{
  const cuda_device_guard device(device_index);
  prepare_guarded_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(decay, plain, step, guard, out);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

void launch_unscale_and_check(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite,
                              int device_index, void* stream)
{
  const cuda_device_guard guard(device_index);
  const unsigned blocks = grid_for(unscale_kernel, device_index, count);
  unscale_kernel<<<blocks, threads_per_block, 0, static_cast<cudaStream_t>(stream)>>>(grad, type, count, factor,
                                                                                      found_nonfinite);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

void launch_cast(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count, int device_index,
                 void* stream)
{
  const cuda_device_guard guard(device_index);
  const unsigned blocks = grid_for(cast_kernel, device_index, count);
  cast_kernel<<<blocks, threads_per_block, 0, static_cast<cudaStream_t>(stream)>>>(dst, dst_type, src, src_type, count);
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

void launch_fill(void* dst, dtype type, std::size_t count, float value, int device_index, void* stream)
{
  const cuda_device_guard guard(device_index);
  auto* s = static_cast<cudaStream_t>(stream);
  if (type == dtype::f32) {
    const unsigned blocks = grid_for(fill32_kernel, device_index, count);
    fill32_kernel<<<blocks, threads_per_block, 0, s>>>(static_cast<std::uint32_t*>(dst), count,
                                                       float_to_bits(canonical(value)));
  } else {
    const unsigned blocks = grid_for(fill16_kernel, device_index, count);
    fill16_kernel<<<blocks, threads_per_block, 0, s>>>(
      static_cast<std::uint16_t*>(dst), count, type == dtype::bf16 ? float_to_bf16(value) : float_to_f16(value));
  }
  TASKSWAP_CUDA_TRY(cudaGetLastError());
}

}  // namespace taskswap::detail
