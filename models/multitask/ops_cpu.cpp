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

// IEEE half: exact widening; narrowing rounds to nearest even (subnormals, overflow to inf), as
// CUDA's __float2half_rn.
float f16_to_float(std::uint16_t h)
{
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16U;
  const std::uint32_t exp = (h >> 10U) & 0x1FU;
  const std::uint32_t man = h & 0x3FFU;
  if (exp == 0x1FU) { return std::bit_cast<float>(sign | 0x7F800000U | (man << 13U)); }
  if (exp != 0) { return std::bit_cast<float>(sign | ((exp + 112U) << 23U) | (man << 13U)); }
  const float magnitude = std::ldexp(static_cast<float>(man), -24);  // subnormal: exact
  return sign != 0 ? -magnitude : magnitude;
}

std::uint16_t to_f16(float f)
{
  const auto u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((u >> 16U) & 0x8000U);
  const std::uint32_t a = u & 0x7FFFFFFFU;
  if (a > 0x7F800000U) { return static_cast<std::uint16_t>(sign | 0x7E00U); }  // NaN
  if (a >= 0x477FF000U) { return static_cast<std::uint16_t>(sign | 0x7C00U); }  // rounds to inf (>= 65520)
  if (a < 0x38800000U) {  // below the smallest normal half: a multiple of 2^-24, rounded to nearest even
    const float scaled = std::bit_cast<float>(a) * 16777216.0F;  // exact: a power of two
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t rounded = a + 0xFFFU + ((a >> 13U) & 1U);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>((rounded - 0x38000000U) >> 13U));
}

float to_float(const void* src, dtype type, std::size_t i)
{
  if (type == dtype::f32) { return static_cast<const float*>(src)[i]; }
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  if (type == dtype::f16) { return f16_to_float(h); }
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

  void relu_backward(float* out, const float* dy, const float* y, std::size_t n) override
  {
    enqueue([=] {
      for (std::size_t i = 0; i < n; ++i) { out[i] = y[i] > 0.0F ? dy[i] : 0.0F; }
    });
  }

  void add(float* out, const float* a, const float* b, std::size_t n) override
  {
    enqueue([=] {
      for (std::size_t i = 0; i < n; ++i) { out[i] = a[i] + b[i]; }
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

  void mse(float* y, const float* target, int rows, int cols, float* loss, float* /*scratch*/,
           const float* loss_scale) override
  {
    enqueue([=] {
      const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
      const float scale = 2.0F / static_cast<float>(n);
      const float by = loss_scale != nullptr ? *loss_scale : 1.0F;
      double sum = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        const float d = y[i] - target[i];
        sum += static_cast<double>(d) * d;
        y[i] = (scale * d) * by;
      }
      *loss = static_cast<float>(sum / static_cast<double>(n));
    });
  }

  void widen(float* dst, const void* src, dtype type, std::size_t n) override
  {
    enqueue([=] {
      for (std::size_t i = 0; i < n; ++i) { dst[i] = to_float(src, type, i); }
    });
  }

  void narrow(void* dst, dtype type, const float* src, std::size_t n) override
  {
    enqueue([=] {
      if (type == dtype::f32) {
        std::memcpy(dst, src, n * sizeof(float));
        return;
      }
      auto* out = static_cast<std::uint16_t*>(dst);
      for (std::size_t i = 0; i < n; ++i) { out[i] = type == dtype::f16 ? to_f16(src[i]) : to_bf16(src[i]); }
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
