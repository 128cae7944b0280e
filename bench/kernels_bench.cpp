// SPDX-License-Identifier: Apache-2.0
// kernels_adamw: the AdamW kernel on 256 Mi parameters (fp32 master and moments; fp32 gradients,
// or bf16 gradients with a bf16 parameter copy), against a device-to-device copy that moves the
// same bytes through memory (a copy of B/2 bytes reads B/2 and writes B/2), both in the same
// benchmark, timed with CUDA events after warm-up. memcpy_ratio = copy time / AdamW time.
// kernels_adamw_guarded/<grad dtype>/<params>: a guarded step's kernels against plain AdamW on the
// same slabs, in the same iterations, with CUDA events:
//   factors_ratio  the guarded AdamW (scalars and the skip flag read from device memory, written by
//                  the one-thread prepare kernel, the gradients unscaled and clipped) plus that
//                  prepare kernel, over plain AdamW. Target <= 1.05.
//   check_ratio    the square sum (the norm and the non-finite check: one more read of the
//                  gradients), the one-thread finish, prepare and guarded AdamW, over plain AdamW.
// Needs a GPU; reports an error where there is none.

#include "host/adamw_formula.hpp"
#include "kernels/kernels.hpp"

#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <span>
#include <vector>

namespace {

using namespace taskswap;
constexpr std::size_t params = std::size_t{256} << 20;

double timed_ms(const device& dev, stream_view s, const std::function<void()>& enqueue)
{
  event start(dev, {.timing = true});
  event end(dev, {.timing = true});
  start.record(s);
  enqueue();
  end.record(s);
  end.synchronize();
  return elapsed_ms(start, end);
}

void kernels_adamw(benchmark::State& state)
{
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device: this benchmark needs a GPU (tools/gpu-check)");
    return;
  }
  const auto grad_type = static_cast<dtype>(state.range(0));
  const bool copy = grad_type != dtype::f32;
  const device dev = cuda_device(0);
  stream s(dev);
  device_buffer master(dev, params * 4), m(dev, params * 4), v(dev, params * 4);
  device_buffer grad(dev, params * size_of(grad_type));
  device_buffer out(dev, copy ? params * 2 : 0);
  const std::size_t bytes = params * (24 + size_of(grad_type) + (copy ? 2 : 0));
  device_buffer copy_src(dev, bytes / 2), copy_dst(dev, bytes / 2);
  detail::fill_async(master.data(), dtype::f32, params, 0.5F, s);
  detail::fill_async(m.data(), dtype::f32, params, 0.0F, s);
  detail::fill_async(v.data(), dtype::f32, params, 0.0F, s);
  detail::fill_async(grad.data(), grad_type, params, 1e-3F, s);
  taskswap::fill_async(copy_src.span(), std::byte{1}, s);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  const detail::adamw_slabs slabs{reinterpret_cast<float*>(master.data()), reinterpret_cast<float*>(m.data()),
                                  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
                                  reinterpret_cast<float*>(v.data()), grad.data(), grad_type,
                                  copy ? out.data() : nullptr, dtype::bf16, params};
  const auto k = detail::make_adamw_scalars({}, 1);
  auto adamw = [&] { detail::adamw_async(slabs, k, s); };
  auto memcpy_same_bytes = [&] { copy_async(copy_dst.span(), copy_src.span(), s); };
  timed_ms(dev, s, adamw);  // warm-up
  timed_ms(dev, s, memcpy_same_bytes);
  double adamw_ms = 0.0;
  double copy_ms = 0.0;
  for (auto _ : state) {
    const double t = timed_ms(dev, s, adamw);
    copy_ms += timed_ms(dev, s, memcpy_same_bytes);
    adamw_ms += t;
    state.SetIterationTime(t / 1e3);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["bytes_per_s"] =
    static_cast<double>(bytes) * static_cast<double>(state.iterations()) / (adamw_ms / 1e3);
  state.counters["memcpy_ratio"] = copy_ms / adamw_ms;
  state.SetLabel(std::string(to_string(grad_type)) + " grads" + (copy ? ", bf16 copy" : ""));
}

void kernels_adamw_guarded(benchmark::State& state)
{
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device: this benchmark needs a GPU (tools/gpu-check)");
    return;
  }
  const auto grad_type = static_cast<dtype>(state.range(0));
  const auto n = static_cast<std::size_t>(state.range(1));
  const device dev = cuda_device(0);
  stream s(dev);
  device_buffer master(dev, n * 4), m(dev, n * 4), v(dev, n * 4), grad(dev, n * size_of(grad_type));
  device_buffer guard_memory(dev, 4096);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): its layout
  auto* guard = reinterpret_cast<detail::step_guard*>(guard_memory.data());
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  auto* block_sums = reinterpret_cast<double*>(guard_memory.data() + 256);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  auto* scalars = reinterpret_cast<detail::adamw_scalars*>(guard_memory.data() + 2560);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  auto* steps = reinterpret_cast<std::int64_t*>(guard_memory.data() + 2816);
  detail::step_guard initial;
  initial.scale = 1024.0F;
  copy_async(guard_memory.span(0, sizeof initial), std::as_bytes(std::span(&initial, 1)), s);
  taskswap::fill_async(guard_memory.span(2816, 8), std::byte{0}, s);
  detail::fill_async(master.data(), dtype::f32, n, 0.5F, s);
  detail::fill_async(m.data(), dtype::f32, n, 0.0F, s);
  detail::fill_async(v.data(), dtype::f32, n, 0.0F, s);
  detail::fill_async(grad.data(), grad_type, n, 1e-3F, s);
  s.synchronize();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  const detail::adamw_slabs slabs{reinterpret_cast<float*>(master.data()), reinterpret_cast<float*>(m.data()),
                                  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
                                  reinterpret_cast<float*>(v.data()), grad.data(), grad_type, nullptr, dtype::bf16, n};
  const adamw_options o{};
  adamw_options plain_o = o;
  plain_o.weight_decay = 0;
  const detail::guard_settings settings{.clip = 1.0F, .scaler = true};
  const auto k = detail::make_adamw_scalars(o, 1);
  auto plain = [&] { detail::adamw_async(slabs, k, s); };
  auto factors = [&] {
    detail::prepare_guarded_async(o, plain_o, steps, guard, scalars, s);
    detail::adamw_async(slabs, scalars, guard, s);
  };
  auto checked = [&] {
    detail::square_sum_async(grad.data(), grad_type, n, guard, block_sums, s);
    detail::finish_guard_async(guard, settings, s);
    factors();
  };
  timed_ms(dev, s, plain);  // warm-up
  timed_ms(dev, s, factors);
  timed_ms(dev, s, checked);
  std::vector<double> factors_ratio;
  std::vector<double> check_ratio;
  for (auto _ : state) {
    const double t_plain = timed_ms(dev, s, plain);
    const double t_factors = timed_ms(dev, s, factors);
    const double t_checked = timed_ms(dev, s, checked);
    factors_ratio.push_back(t_factors / t_plain);
    check_ratio.push_back(t_checked / t_plain);
    state.SetIterationTime(t_checked / 1e3);
  }
  std::sort(factors_ratio.begin(), factors_ratio.end());
  std::sort(check_ratio.begin(), check_ratio.end());
  state.SetBytesProcessed(static_cast<std::int64_t>(n * (24 + size_of(grad_type))) * state.iterations());
  state.counters["factors_ratio"] = factors_ratio[factors_ratio.size() / 2];
  state.counters["check_ratio"] = check_ratio[check_ratio.size() / 2];
  state.SetLabel(std::string(to_string(grad_type)) + " grads");
}

}  // namespace

BENCHMARK(kernels_adamw_guarded)
  ->ArgsProduct({{static_cast<int>(dtype::f32), static_cast<int>(dtype::f16)}, {1 << 20, 3 << 22, 1 << 26, 3 << 26}})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond);

BENCHMARK(kernels_adamw)
  ->Arg(static_cast<int>(dtype::f32))
  ->Arg(static_cast<int>(dtype::bf16))
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond);
