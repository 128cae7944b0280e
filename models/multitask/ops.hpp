// SPDX-License-Identifier: Apache-2.0
#pragma once

// The few operations the sample model needs, enqueued on the stream the ops were made for (one
// trainer stream: binding it once keeps the calls short): GEMMs through cuBLAS on the cuda
// backend and OpenBLAS on the emulated one, and small element-wise kernels. All arrays are
// row-major f32 in device memory except where a dtype is named; results overwrite their outputs
// (the model's gradient slabs arrive zeroed and are written once per step). Nothing here
// synchronises.

#include <taskswap/taskswap.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace multitask {

class ops {
 public:
  virtual ~ops() = default;
  ops() = default;
  ops(const ops&) = delete;
  ops& operator=(const ops&) = delete;

  /// c[m×n] = alpha · op(a) · op(b) + beta · c, where op(a) is m×k (a stored k×m when ta) and
  /// op(b) is k×n (b stored n×k when tb).
  virtual void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
                    float* c) = 0;
  /// x[i] = scale · u(key, i), u uniform in [-1, 1) from a counter-based hash: the same numbers on
  /// every backend, whatever the order of work.
  virtual void random_uniform(float* x, std::size_t n, std::uint64_t key, float scale) = 0;
  /// y[r][c] += b[c], then max(y, 0) when relu.
  virtual void bias_activation(float* y, const float* b, int rows, int cols, bool relu) = 0;
  /// out[i] = y[i] > 0 ? dy[i] : 0 (the ReLU's backward, from its output); `out` may be `dy`.
  virtual void relu_backward(float* out, const float* dy, const float* y, std::size_t n) = 0;
  /// out[i] = a[i] + b[i] (a residual connection); `out` may be `a` or `b`.
  virtual void add(float* out, const float* a, const float* b, std::size_t n) = 0;
  /// out[c] = sum over r of x[r][c] (overwrites out). `scratch`: scratch_floats(cols) floats.
  virtual void column_sums(float* out, const float* x, int rows, int cols, float* scratch) = 0;
  /// Mean squared error: *loss = mean((y - t)^2); y becomes dLoss/dy = 2 (y - t) / (rows · cols),
  /// times *loss_scale when it is given (a device float: the runtime's loss scale, as
  /// GradScaler.scale(loss) multiplies the loss). `scratch`: scratch_floats(cols) floats.
  virtual void mse(float* y, const float* target, int rows, int cols, float* loss, float* scratch,
                   const float* loss_scale) = 0;
  /// dst (f32) = src of type `type` (f32, bf16 or f16).
  virtual void widen(float* dst, const void* src, taskswap::dtype type, std::size_t n) = 0;
  /// dst of type `type` (f32, bf16 or f16) = src rounded to nearest even.
  virtual void narrow(void* dst, taskswap::dtype type, const float* src, std::size_t n) = 0;
};

/// The implementation for `s`'s device: cuBLAS and CUDA kernels, or OpenBLAS and loops run on
/// the emulated stream's worker.
[[nodiscard]] std::unique_ptr<ops> make_ops(const taskswap::device& dev, taskswap::stream_view s);

#if defined(__CUDACC__)
#define MULTITASK_HOST_DEVICE __host__ __device__
#else
#define MULTITASK_HOST_DEVICE
#endif

/// The hash behind random_uniform, shared by the backends and the host-side initialisation.
[[nodiscard]] MULTITASK_HOST_DEVICE constexpr std::uint64_t mix(std::uint64_t x) noexcept
{
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27U)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31U);
}

/// u(key, i) in [-1, 1): 24 random bits, exact in f32 (the product by 2^-23 is exact, so a fused
/// multiply-add gives the same value).
[[nodiscard]] MULTITASK_HOST_DEVICE constexpr float uniform(std::uint64_t key, std::uint64_t i) noexcept
{
  const auto bits = static_cast<std::uint32_t>(mix(key ^ mix(i)) >> 40U);
  return static_cast<float>(bits) * (1.0F / 8388608.0F) - 1.0F;
}

/// Floats of scratch the reductions need for matrices of up to `cols` columns (a workspace buffer).
[[nodiscard]] constexpr std::size_t scratch_floats(std::size_t cols) noexcept
{
  return 64 * cols > 512 ? 64 * cols : 512;
}

/// The backends (ops_cpu.cpp, ops_cuda.cu).
[[nodiscard]] std::unique_ptr<ops> make_cpu_ops(taskswap::stream_view s);
[[nodiscard]] std::unique_ptr<ops> make_cuda_ops(int device_index, taskswap::stream_view s);

}  // namespace multitask
