// SPDX-License-Identifier: Apache-2.0
// The emulated backend's operations: each is a host function on the stream, so it runs on the
// stream's worker in order with the runtime's copies, on "device" memory that is host memory.

#include "ops.hpp"

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace multitask {
namespace {

using taskswap::dtype;

void refuse_f16(dtype type)
{
  if (type == dtype::f16) { throw taskswap::invalid_argument("the sample computes in f32 or bf16, not f16"); }
}

float to_float(const void* src, dtype type, std::size_t i)
{
  if (type == dtype::f32) { return static_cast<const float*>(src)[i]; }
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16U);  // bf16: the top half of an f32
}

std::uint16_t to_bf16(float f)
{
  const auto u = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) { return static_cast<std::uint16_t>((u >> 16U) | 0x40U); }
  const std::uint32_t rounding = 0x7fffU + ((u >> 16U) & 1U);
  return static_cast<std::uint16_t>((u + rounding) >> 16U);
}

class cpu_ops final : public ops {
 public:
  explicit cpu_ops(taskswap::stream_view s) : s_(s) {}

  void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, const float* b, float beta,
            float* c) override
  {
    enqueue([=] {
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a,
                  ta ? m : k, b, tb ? k : n, beta, c, n);
    });
  }

  void random_uniform(float* x, std::size_t n, std::uint64_t key, float scale) override
  {
    enqueue([=] {
      for (std::size_t i = 0; i < n; ++i) { x[i] = scale * uniform(key, i); }
    });
  }

  void bias_activation(float* y, const float* b, int rows, int cols, bool relu) override
  {
    enqueue([=] {
      for (int r = 0; r < rows; ++r) {
        float* row = y + static_cast<std::size_t>(r) * static_cast<std::size_t>(cols);
        for (int c = 0; c < cols; ++c) {
          const float v = row[c] + b[c];
          row[c] = relu && !(v > 0.0F) ? 0.0F : v;
        }
      }
    });
  }

  void relu_backward(float* dy, const float* y, std::size_t n) override
  {
    enqueue([=] {
      for (std::size_t i = 0; i < n; ++i) {
        if (!(y[i] > 0.0F)) { dy[i] = 0.0F; }
      }
    });
  }

  void column_sums(float* out, const float* x, int rows, int cols, float* /*scratch*/) override
  {
    enqueue([=] {
      std::fill(out, out + cols, 0.0F);
      for (int r = 0; r < rows; ++r) {
        const float* row = x + static_cast<std::size_t>(r) * static_cast<std::size_t>(cols);
        for (int c = 0; c < cols; ++c) { out[c] += row[c]; }
      }
    });
  }

  void mse(float* y, const float* target, int rows, int cols, float* loss, float* /*scratch*/) override
  {
    enqueue([=] {
      const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
      const float scale = 2.0F / static_cast<float>(n);
      double sum = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        const float d = y[i] - target[i];
        sum += static_cast<double>(d) * d;
        y[i] = scale * d;
      }
      *loss = static_cast<float>(sum / static_cast<double>(n));
    });
  }

  void widen(float* dst, const void* src, dtype type, std::size_t n) override
  {
    refuse_f16(type);
    enqueue([=] {
      for (std::size_t i = 0; i < n; ++i) { dst[i] = to_float(src, type, i); }
    });
  }

  void narrow(void* dst, dtype type, const float* src, std::size_t n) override
  {
    refuse_f16(type);
    enqueue([=] {
      if (type == dtype::f32) {
        std::memcpy(dst, src, n * sizeof(float));
        return;
      }
      auto* out = static_cast<std::uint16_t*>(dst);
      for (std::size_t i = 0; i < n; ++i) { out[i] = to_bf16(src[i]); }
    });
  }

 private:
  template <typename F>
  void enqueue(F&& f)
  {
    taskswap::launch_host_func(s_, std::forward<F>(f));
  }
  taskswap::stream_view s_;
};

}  // namespace

std::unique_ptr<ops> make_cpu_ops(taskswap::stream_view s) { return std::make_unique<cpu_ops>(s); }

}  // namespace multitask
