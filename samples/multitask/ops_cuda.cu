// SPDX-License-Identifier: Apache-2.0
// The cuda backend's operations: cuBLAS for the GEMMs (f32, default math: no TF32, so runs are
// deterministic and comparable), small kernels for the rest. Reductions use one fixed tree per
// block, so results do not depend on scheduling.

#include "ops.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

namespace multitask {
namespace {

using taskswap::dtype;

constexpr int threads = 256;

void check(cudaError_t e, const char* what)
{
  if (e != cudaSuccess) { throw taskswap::cuda_error(std::string(what) + ": " + cudaGetErrorString(e)); }
}

void check(cublasStatus_t e, const char* what)
{
  if (e == CUBLAS_STATUS_ALLOC_FAILED) {
    throw taskswap::out_of_memory(std::string(what) + ": cuBLAS could not allocate its workspace", 0, 0, 0);
  }
  if (e != CUBLAS_STATUS_SUCCESS) {
    throw taskswap::cuda_error(std::string(what) + ": " + cublasGetStatusString(e));
  }
}

unsigned blocks_for(std::size_t n)
{
  const std::size_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 16 ? (b == 0 ? 1 : b) : 65535 * 16);
}

__device__ std::uint64_t mix_d(std::uint64_t x)
{
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27U)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31U);
}

__global__ void random_kernel(float* x, std::size_t n, std::uint64_t key, float scale)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    const auto bits = static_cast<std::uint32_t>(mix_d(key ^ mix_d(i)) >> 40U);
    x[i] = __fmul_rn(scale, __fsub_rn(__fmul_rn(static_cast<float>(bits), 1.0F / 8388608.0F), 1.0F));
  }
}

__global__ void bias_activation_kernel(float* y, const float* b, std::size_t n, int cols, bool relu)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    const float v = __fadd_rn(y[i], b[i % static_cast<std::size_t>(cols)]);
    y[i] = relu && !(v > 0.0F) ? 0.0F : v;
  }
}

__global__ void relu_backward_kernel(float* dy, const float* y, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    if (!(y[i] > 0.0F)) { dy[i] = 0.0F; }
  }
}

// One block per column: a strided sum per thread, then a fixed tree.
__global__ void column_sums_kernel(float* out, const float* x, int rows, int cols)
{
  __shared__ float partial[threads];
  const int c = static_cast<int>(blockIdx.x);
  float sum = 0.0F;
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += threads) {
    sum = __fadd_rn(sum, x[static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(c)]);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int w = threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) { partial[threadIdx.x] = __fadd_rn(partial[threadIdx.x], partial[threadIdx.x + w]); }
    __syncthreads();
  }
  if (threadIdx.x == 0) { out[c] = partial[0]; }
}

// One block: the gradient element-wise, the loss by a fixed tree (in double).
__global__ void mse_kernel(float* y, const float* t, std::size_t n, float* loss)
{
  __shared__ double partial[threads];
  const float scale = 2.0F / static_cast<float>(n);
  double sum = 0.0;
  for (std::size_t i = threadIdx.x; i < n; i += threads) {
    const float d = __fsub_rn(y[i], t[i]);
    sum += static_cast<double>(d) * d;
    y[i] = __fmul_rn(scale, d);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int w = threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) { partial[threadIdx.x] += partial[threadIdx.x + w]; }
    __syncthreads();
  }
  if (threadIdx.x == 0) { *loss = static_cast<float>(partial[0] / static_cast<double>(n)); }
}

__global__ void widen_kernel(float* dst, const __nv_bfloat16* src, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

__global__ void narrow_kernel(__nv_bfloat16* dst, const float* src, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

class cuda_ops final : public ops {
 public:
  explicit cuda_ops(taskswap::stream_view s) : s_(static_cast<cudaStream_t>(s.native_handle()))
  {
    check(cublasCreate(&handle_), "cublasCreate");
    check(cublasSetStream(handle_, s_), "cublasSetStream");
  }
  ~cuda_ops() override { cublasDestroy(handle_); }
  cuda_ops(const cuda_ops&) = delete;
  cuda_ops& operator=(const cuda_ops&) = delete;

  void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override
  {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    check(cublasSgemm(handle_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b,
                      tb ? k : n, a, ta ? m : k, &beta, c, n),
          "cublasSgemm");
  }

  void random_uniform(float* x, std::size_t n, std::uint64_t key, float scale) override
  {
    random_kernel<<<blocks_for(n), threads, 0, s_>>>(x, n, key, scale);
    check(cudaGetLastError(), "random_uniform");
  }

  void bias_activation(float* y, const float* b, int rows, int cols, bool relu) override
  {
    const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
    bias_activation_kernel<<<blocks_for(n), threads, 0, s_>>>(y, b, n, cols, relu);
    check(cudaGetLastError(), "bias_activation");
  }

  void relu_backward(float* dy, const float* y, std::size_t n) override
  {
    relu_backward_kernel<<<blocks_for(n), threads, 0, s_>>>(dy, y, n);
    check(cudaGetLastError(), "relu_backward");
  }

  void column_sums(float* out, const float* x, int rows, int cols) override
  {
    column_sums_kernel<<<static_cast<unsigned>(cols), threads, 0, s_>>>(out, x, rows, cols);
    check(cudaGetLastError(), "column_sums");
  }

  void mse(float* y, const float* target, int rows, int cols, float* loss) override
  {
    mse_kernel<<<1, threads, 0, s_>>>(y, target, static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols), loss);
    check(cudaGetLastError(), "mse");
  }

  void widen(float* dst, const void* src, dtype type, std::size_t n) override
  {
    if (type == dtype::f32) {
      check(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, s_), "widen");
      return;
    }
    widen_kernel<<<blocks_for(n), threads, 0, s_>>>(dst, static_cast<const __nv_bfloat16*>(src), n);
    check(cudaGetLastError(), "widen");
  }

  void narrow(void* dst, dtype type, const float* src, std::size_t n) override
  {
    if (type == dtype::f32) {
      check(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, s_), "narrow");
      return;
    }
    narrow_kernel<<<blocks_for(n), threads, 0, s_>>>(static_cast<__nv_bfloat16*>(dst), src, n);
    check(cudaGetLastError(), "narrow");
  }

 private:
  cudaStream_t s_;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace

std::unique_ptr<ops> make_cuda_ops(taskswap::stream_view s) { return std::make_unique<cuda_ops>(s); }

}  // namespace multitask
