// SPDX-License-Identifier: Apache-2.0
// The sample model's operations against double-precision references, on each backend: the
// emulated one here, the cuda one (label gpu) where there is a GPU. Outputs are poisoned first,
// so an operation that writes nothing fails.

#include "cuda_skip.hpp"
#include "numeric/dtype_conversion.hpp"
#include "ops.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <deque>
#include <optional>
#include <limits>
#include <vector>

namespace {

using taskswap::dtype;

struct emulated_backend {
  static taskswap::device make()
  {
    return taskswap::emulated_device({.memory_bytes = std::size_t{64} << 20U, .link = {}});
  }
  static std::string skip_reason() { return {}; }
};

struct cuda_backend {
  static taskswap::device make() { return taskswap::cuda_device(0); }
  static std::string skip_reason() { return taskswap::test::cuda_skip_reason(); }
};

template <typename Backend>
class ops_test : public ::testing::Test {
 protected:
  void SetUp() override
  {
    if (const std::string why = Backend::skip_reason(); !why.empty()) { GTEST_SKIP() << why; }
    dev_.emplace(Backend::make());
    stream_.emplace(*dev_);
    ops_ = multitask::make_ops(*dev_, *stream_);
  }

  // A device copy of `host`, and back.
  float* upload(const std::vector<float>& host)
  {
    buffers_.emplace_back(*dev_, std::max<std::size_t>(host.size() * sizeof(float), 256));
    taskswap::device_buffer& b = buffers_.back();
    if (!host.empty()) {
      taskswap::copy_async(b.span(0, host.size() * sizeof(float)), std::as_bytes(std::span(host)), *stream_);
    }
    stream_->synchronize();
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): holds floats
    return reinterpret_cast<float*>(b.data());
  }
  float* poisoned(std::size_t n) { return upload(std::vector<float>(n, std::nanf(""))); }
  std::vector<float> download(const float* p, std::size_t n)
  {
    std::vector<float> host(n);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    const auto* bytes = reinterpret_cast<const std::byte*>(p);
    for (const taskswap::device_buffer& b : buffers_) {
      if (bytes >= b.data() && bytes < b.data() + b.size()) {
        taskswap::copy_async(std::as_writable_bytes(std::span(host)),
                             b.span(static_cast<std::size_t>(bytes - b.data()), n * sizeof(float)), *stream_);
      }
    }
    stream_->synchronize();
    return host;
  }
  static std::vector<float> random(std::size_t n, std::uint64_t key)
  {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) { v[i] = multitask::uniform(key, i); }
    return v;
  }

  std::optional<taskswap::device> dev_;
  std::optional<taskswap::stream> stream_;
  std::unique_ptr<multitask::ops> ops_;
  std::deque<taskswap::device_buffer> buffers_;
};

#if MULTITASK_OPS_TEST_CUDA
using backends = ::testing::Types<cuda_backend>;  // the gpu-labelled executable
#else
using backends = ::testing::Types<emulated_backend>;
#endif
class backend_names {
 public:
  template <typename T>
  static std::string GetName(int /*unused*/)
  {
    return std::is_same_v<T, emulated_backend> ? "emulated" : "cuda";
  }
};
TYPED_TEST_SUITE(ops_test, backends, backend_names);

TYPED_TEST(ops_test, gemm_in_every_transpose_matches_a_double_reference)
{
  const int m = 37;
  const int n = 23;
  const int k = 19;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      const auto a = this->random(static_cast<std::size_t>(m * k), 1);
      const auto b = this->random(static_cast<std::size_t>(k * n), 2);
      const auto c0 = this->random(static_cast<std::size_t>(m * n), 3);
      float* c = this->upload(c0);
      this->ops_->gemm(ta, tb, m, n, k, 0.5F, this->upload(a), this->upload(b), 2.0F, c);
      const auto got = this->download(c, static_cast<std::size_t>(m * n));
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double want = 2.0 * c0[static_cast<std::size_t>(i * n + j)];
          for (int p = 0; p < k; ++p) {
            const float av = ta ? a[static_cast<std::size_t>(p * m + i)] : a[static_cast<std::size_t>(i * k + p)];
            const float bv = tb ? b[static_cast<std::size_t>(j * k + p)] : b[static_cast<std::size_t>(p * n + j)];
            want += 0.5 * static_cast<double>(av) * bv;
          }
          ASSERT_NEAR(got[static_cast<std::size_t>(i * n + j)], want, 1e-5 * (1 + std::fabs(want)))
            << "ta " << ta << " tb " << tb << " at " << i << "," << j;
        }
      }
    }
  }
}

TYPED_TEST(ops_test, random_uniform_is_the_host_hash_bit_for_bit)
{
  const std::size_t n = 10'007;
  float* x = this->poisoned(n);
  this->ops_->random_uniform(x, n, 99, 0.25F);
  const auto got = this->download(x, n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(0.25F * multitask::uniform(99, i)))
      << i;
  }
}

TYPED_TEST(ops_test, bias_relu_and_its_backward)
{
  const int rows = 300;
  const int cols = 33;
  const auto y0 = this->random(static_cast<std::size_t>(rows * cols), 4);
  const auto b = this->random(static_cast<std::size_t>(cols), 5);
  float* y = this->upload(y0);
  this->ops_->bias_activation(y, this->upload(b), rows, cols, true);
  const auto out = this->download(y, y0.size());
  for (std::size_t i = 0; i < y0.size(); ++i) {
    const float v = y0[i] + b[i % static_cast<std::size_t>(cols)];
    ASSERT_EQ(out[i], v > 0 ? v : 0.0F) << i;
  }
  const auto d0 = this->random(y0.size(), 6);
  float* d = this->upload(d0);
  float* masked = this->poisoned(y0.size());
  this->ops_->relu_backward(masked, d, y, y0.size());  // into another array: d stays
  this->ops_->relu_backward(d, d, y, y0.size());  // in place
  const auto into = this->download(masked, y0.size());
  const auto grad = this->download(d, y0.size());
  for (std::size_t i = 0; i < y0.size(); ++i) {
    ASSERT_EQ(into[i], out[i] > 0 ? d0[i] : 0.0F) << i;
    ASSERT_EQ(grad[i], into[i]) << i;
  }
}

TYPED_TEST(ops_test, add_is_the_elementwise_sum)
{
  const std::size_t n = 1000;
  const auto a0 = this->random(n, 7);
  const auto b0 = this->random(n, 8);
  float* a = this->upload(a0);
  float* out = this->poisoned(n);
  this->ops_->add(out, a, this->upload(b0), n);
  this->ops_->add(a, a, a, n);  // in place
  const auto sum = this->download(out, n);
  const auto twice = this->download(a, n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(sum[i], a0[i] + b0[i]) << i;
    ASSERT_EQ(twice[i], 2.0F * a0[i]) << i;
  }
}

TYPED_TEST(ops_test, column_sums_and_mse_match_double_references_and_are_deterministic)
{
  const int rows = 5'000;
  const int cols = 70;
  const auto x0 = this->random(static_cast<std::size_t>(rows * cols), 7);
  float* x = this->upload(x0);
  float* scratch = this->poisoned(multitask::scratch_floats(static_cast<std::size_t>(cols)));
  float* out = this->poisoned(static_cast<std::size_t>(cols));
  this->ops_->column_sums(out, x, rows, cols, scratch);
  const auto sums = this->download(out, static_cast<std::size_t>(cols));
  for (int c = 0; c < cols; ++c) {
    double want = 0;
    for (int r = 0; r < rows; ++r) { want += x0[static_cast<std::size_t>(r * cols + c)]; }
    ASSERT_NEAR(sums[static_cast<std::size_t>(c)], want, 1e-3) << c;
  }
  this->ops_->column_sums(out, x, rows, cols, scratch);
  EXPECT_EQ(this->download(out, static_cast<std::size_t>(cols)), sums) << "a second run gives the same bits";

  const auto t0 = this->random(x0.size(), 8);
  float* loss = this->poisoned(1);
  float* x_scaled = this->upload(this->download(x, x0.size()));
  this->ops_->mse(x, this->upload(t0), rows, cols, loss, scratch, nullptr);
  const auto l = this->download(loss, 1)[0];
  const auto g = this->download(x, x0.size());
  // With a loss scale the gradient is scaled and the loss is not.
  float* scaled_loss = this->poisoned(1);
  this->ops_->mse(x_scaled, this->upload(t0), rows, cols, scaled_loss, scratch,
                  this->upload(std::vector<float>{1024.0F}));
  EXPECT_EQ(this->download(scaled_loss, 1)[0], l);
  const auto gs = this->download(x_scaled, x0.size());
  for (std::size_t i = 0; i < x0.size(); ++i) { ASSERT_EQ(gs[i], g[i] * 1024.0F) << i; }
  double want = 0;
  for (std::size_t i = 0; i < x0.size(); ++i) {
    const double e = static_cast<double>(x0[i] - t0[i]);
    want += e * e;
    ASSERT_FLOAT_EQ(g[i], 2.0F / static_cast<float>(x0.size()) * (x0[i] - t0[i])) << i;
  }
  EXPECT_NEAR(l, want / static_cast<double>(x0.size()), 1e-6);
}

TYPED_TEST(ops_test, bf16_and_f16_widen_and_narrow_round_to_nearest_even)
{
  const std::vector<float> values{1.0F, 1.00390625F, 1.01171875F, -3.5F, 1e-3F, 65504.0F};
  float* src = this->upload(values);
  float* half = this->poisoned(values.size());  // room for the bf16 values
  this->ops_->narrow(half, dtype::bf16, src, values.size());
  float* back = this->poisoned(values.size());
  this->ops_->widen(back, half, dtype::bf16, values.size());
  const auto got = this->download(back, values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(values[i]);
    const std::uint32_t rounded = (u + 0x7fffU + ((u >> 16U) & 1U)) & 0xffff0000U;
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got[i]), rounded) << values[i];
  }
  // f16 against the library's conversion: ties, subnormals, the largest half, overflow, NaN.
  const std::vector<float> f16_values{
    1.0F,         1.00048828125F, 1.00146484375F, -3.5F,
    1e-3F,        65504.0F,       65519.0F,       65520.0F,
    1e9F,         -1e9F,          5.9604645e-8F,  2.9802322e-8F,
    8.940697e-8F, 6.1e-5F,        -1.5e-7F,       std::numeric_limits<float>::quiet_NaN(),
    0.0F,         -0.0F};
  float* f16_src = this->upload(f16_values);
  float* f16_half = this->poisoned(f16_values.size());
  this->ops_->narrow(f16_half, dtype::f16, f16_src, f16_values.size());
  float* f16_back = this->poisoned(f16_values.size());
  this->ops_->widen(f16_back, f16_half, dtype::f16, f16_values.size());
  const auto f16_got = this->download(f16_back, f16_values.size());
  for (std::size_t i = 0; i < f16_values.size(); ++i) {
    const float want = taskswap::detail::f16_to_float(taskswap::detail::float_to_f16(f16_values[i]));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f16_got[i])) << f16_values[i];
    } else {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(f16_got[i]), std::bit_cast<std::uint32_t>(want)) << f16_values[i];
    }
  }
}

}  // namespace
