// SPDX-License-Identifier: Apache-2.0
// The cuda backend's operations: cuBLAS for the GEMMs (f32, default math: no TF32, so runs are
// deterministic and comparable), small kernels for the rest. Every call makes the ops' device
// current first (the trainer's thread may have another). Reductions run in two passes over a
// grid whose shape depends only on the sizes, each with a fixed tree, so results do not depend
// on scheduling.

#include "ops.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>

namespace multitask {
namespace {

using taskswap::dtype;

constexpr int threads = 256;
constexpr int partial_blocks = 256;  // the first pass of mse: partial sums (doubles) in the scratch
constexpr int row_chunks = 64;  // the first pass of column_sums: 64 partial sums per column

std::string where(const char* call, const char* file, int line)
{
  return std::string(call) + " (" + file + ":" + std::to_string(line) + ")";
}

void check_cuda(cudaError_t e, const char* call, const char* file, int line)
{
  if (e != cudaSuccess) {
    throw taskswap::cuda_error(where(call, file, line) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
}

void check_cublas(cublasStatus_t e, const char* call, const char* file, int line)
{
  if (e == CUBLAS_STATUS_ALLOC_FAILED) {
    std::size_t free = 0;
    std::size_t total = 0;
    (void)cudaMemGetInfo(&free, &total);
    throw taskswap::out_of_memory(where(call, file, line) + ": cuBLAS could not allocate its workspace (" +
                                    std::to_string(free) + " of " + std::to_string(total) + " device bytes free)",
                                  0, free, total);
  }
  if (e != CUBLAS_STATUS_SUCCESS) {
    throw taskswap::cuda_error(where(call, file, line) + ": " + cublasGetStatusName(e) + ": " +
                               cublasGetStatusString(e));
  }
}

#define MULTITASK_CUDA(call) check_cuda((call), #call, __FILE__, __LINE__)
#define MULTITASK_CUBLAS(call) check_cublas((call), #call, __FILE__, __LINE__)

// Makes the ops' device current for one call and restores the caller's.
class device_scope {
 public:
  explicit device_scope(int index)
  {
    MULTITASK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != index) { MULTITASK_CUDA(cudaSetDevice(index)); }
    switched_ = previous_ != index;
  }
  ~device_scope()
  {
    if (switched_) { (void)cudaSetDevice(previous_); }
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

unsigned blocks_for(std::size_t n)
{
  const std::size_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::size_t>(b, 1, std::size_t{65535} * 16));
}

__global__ void random_kernel(float* x, std::size_t n, std::uint64_t key, float scale)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    x[i] = __fmul_rn(scale, uniform(key, i));
  }
}

__global__ void bias_activation_kernel(float* y, const float* b, std::size_t n, int cols, bool relu)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const float v = __fadd_rn(y[i], b[i % static_cast<std::size_t>(cols)]);
    y[i] = relu && !(v > 0.0F) ? 0.0F : v;
  }
}

__global__ void relu_backward_kernel(float* out, const float* dy, const float* y, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = y[i] > 0.0F ? dy[i] : 0.0F;
  }
}

__global__ void add_kernel(float* out, const float* a, const float* b, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = __fadd_rn(a[i], b[i]);
  }
}

// Column sums, pass 1: block (32 columns × 8 rows) per tile of columns and chunk of rows; lanes
// read consecutive columns (coalesced); the 8 row-phases meet in a fixed tree.
__global__ void column_partials_kernel(float* partial, const float* x, int rows, int cols)
{
  __shared__ float tile[8][33];
  const int c = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  const int chunk = static_cast<int>(blockIdx.y);
  const int per_chunk = (rows + row_chunks - 1) / row_chunks;
  const int r0 = chunk * per_chunk;
  const int r1 = min(rows, r0 + per_chunk);
  float sum = 0.0F;
  if (c < cols) {
    for (int r = r0 + static_cast<int>(threadIdx.y); r < r1; r += 8) {
      sum =
        __fadd_rn(sum, x[static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(c)]);
    }
  }
  tile[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  for (int w = 4; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.y) < w) {
      tile[threadIdx.y][threadIdx.x] = __fadd_rn(tile[threadIdx.y][threadIdx.x], tile[threadIdx.y + w][threadIdx.x]);
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && c < cols) {
    partial[static_cast<std::size_t>(chunk) * static_cast<std::size_t>(cols) + c] = tile[0][threadIdx.x];
  }
}

// Column sums, pass 2: each column's chunks in order.
__global__ void column_finish_kernel(float* out, const float* partial, int cols)
{
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= cols) { return; }
  float sum = 0.0F;
  for (int k = 0; k < row_chunks; ++k) {
    sum = __fadd_rn(sum, partial[static_cast<std::size_t>(k) * static_cast<std::size_t>(cols) + c]);
  }
  out[c] = sum;
}

// MSE, pass 1: the gradient element-wise; each block's squared errors (double) by a fixed tree.
__global__ void mse_partials_kernel(float* y, const float* t, std::size_t n, double* partial, const float* loss_scale)
{
  __shared__ double tree[threads];
  const float scale = 2.0F / static_cast<float>(n);
  const float by = loss_scale != nullptr ? *loss_scale : 1.0F;
  double sum = 0.0;
  for (std::size_t i = blockIdx.x * std::size_t{threads} + threadIdx.x; i < n;
       i += std::size_t{partial_blocks} * threads) {
    const float d = __fsub_rn(y[i], t[i]);
    sum += static_cast<double>(d) * d;
    y[i] = __fmul_rn(__fmul_rn(scale, d), by);
  }
  tree[threadIdx.x] = sum;
  __syncthreads();
  for (int w = threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) { tree[threadIdx.x] += tree[threadIdx.x + w]; }
    __syncthreads();
  }
  if (threadIdx.x == 0) { partial[blockIdx.x] = tree[0]; }
}

// MSE, pass 2: the blocks' sums by a fixed tree.
__global__ void mse_finish_kernel(const double* partial, std::size_t n, float* loss)
{
  __shared__ double tree[partial_blocks];
  tree[threadIdx.x] = partial[threadIdx.x];
  __syncthreads();
  for (int w = partial_blocks / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) { tree[threadIdx.x] += tree[threadIdx.x + w]; }
    __syncthreads();
  }
  if (threadIdx.x == 0) { *loss = static_cast<float>(tree[0] / static_cast<double>(n)); }
}

__device__ inline float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_f32(__half x) { return __half2float(x); }
template <typename T>
__device__ inline T from_f32(float x);
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float x)
{
  return __float2bfloat16_rn(x);
}
template <>
__device__ inline __half from_f32<__half>(float x)
{
  return __float2half_rn(x);
}

// T: __nv_bfloat16 or __half; both round to nearest even.
template <typename T>
__global__ void widen_kernel(float* dst, const T* src, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = to_f32(src[i]);
  }
}

template <typename T>
__global__ void narrow_kernel(T* dst, const float* src, std::size_t n)
{
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = from_f32<T>(src[i]);
  }
}

struct handle_deleter {
  void operator()(cublasContext* h) const noexcept { (void)cublasDestroy(h); }
};

class cuda_ops final : public ops {
 public:
  cuda_ops(int device_index, taskswap::stream_view s)
      : device_(device_index), s_(static_cast<cudaStream_t>(s.native_handle()))
  {
    const device_scope scope(device_);
    cublasHandle_t h = nullptr;
    MULTITASK_CUBLAS(cublasCreate(&h));
    handle_.reset(h);
    MULTITASK_CUBLAS(cublasSetStream(handle_.get(), s_));
  }

  void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override
  {
    const device_scope scope(device_);
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    MULTITASK_CUBLAS(cublasSgemm(handle_.get(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                                 &alpha, b, tb ? k : n, a, ta ? m : k, &beta, c, n));
  }

  void random_uniform(float* x, std::size_t n, std::uint64_t key, float scale) override
  {
    const device_scope scope(device_);
    random_kernel<<<blocks_for(n), threads, 0, s_>>>(x, n, key, scale);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void bias_activation(float* y, const float* b, int rows, int cols, bool relu) override
  {
    const device_scope scope(device_);
    const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
    bias_activation_kernel<<<blocks_for(n), threads, 0, s_>>>(y, b, n, cols, relu);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void relu_backward(float* out, const float* dy, const float* y, std::size_t n) override
  {
    const device_scope scope(device_);
    relu_backward_kernel<<<blocks_for(n), threads, 0, s_>>>(out, dy, y, n);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void add(float* out, const float* a, const float* b, std::size_t n) override
  {
    const device_scope scope(device_);
    add_kernel<<<blocks_for(n), threads, 0, s_>>>(out, a, b, n);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void column_sums(float* out, const float* x, int rows, int cols, float* scratch) override
  {
    const device_scope scope(device_);
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), row_chunks);
    column_partials_kernel<<<grid, dim3(32, 8), 0, s_>>>(scratch, x, rows, cols);
    MULTITASK_CUDA(cudaGetLastError());
    column_finish_kernel<<<static_cast<unsigned>((cols + threads - 1) / threads), threads, 0, s_>>>(out, scratch, cols);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void mse(float* y, const float* target, int rows, int cols, float* loss, float* scratch,
           const float* loss_scale) override
  {
    const device_scope scope(device_);
    const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): scratch_floats() leaves room for 256 doubles
    auto* partial = reinterpret_cast<double*>(scratch);
    mse_partials_kernel<<<partial_blocks, threads, 0, s_>>>(y, target, n, partial, loss_scale);
    MULTITASK_CUDA(cudaGetLastError());
    mse_finish_kernel<<<1, partial_blocks, 0, s_>>>(partial, n, loss);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void widen(float* dst, const void* src, dtype type, std::size_t n) override
  {
    const device_scope scope(device_);
    if (type == dtype::f32) {
      MULTITASK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, s_));
      return;
    }
    if (type == dtype::f16) {
      widen_kernel<<<blocks_for(n), threads, 0, s_>>>(dst, static_cast<const __half*>(src), n);
      MULTITASK_CUDA(cudaGetLastError());
      return;
    }
    widen_kernel<<<blocks_for(n), threads, 0, s_>>>(dst, static_cast<const __nv_bfloat16*>(src), n);
    MULTITASK_CUDA(cudaGetLastError());
  }

  void narrow(void* dst, dtype type, const float* src, std::size_t n) override
  {
    const device_scope scope(device_);
    if (type == dtype::f32) {
      MULTITASK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, s_));
      return;
    }
    if (type == dtype::f16) {
      narrow_kernel<<<blocks_for(n), threads, 0, s_>>>(static_cast<__half*>(dst), src, n);
      MULTITASK_CUDA(cudaGetLastError());
      return;
    }
    narrow_kernel<<<blocks_for(n), threads, 0, s_>>>(static_cast<__nv_bfloat16*>(dst), src, n);
    MULTITASK_CUDA(cudaGetLastError());
  }

 private:
  int device_;
  cudaStream_t s_;
  std::unique_ptr<cublasContext, handle_deleter> handle_;
};

}  // namespace

std::unique_ptr<ops> make_cuda_ops(int device_index, taskswap::stream_view s)
{
  return std::make_unique<cuda_ops>(device_index, s);
}

}  // namespace multitask
