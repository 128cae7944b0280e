// SPDX-License-Identifier: Apache-2.0
// kernels_adamw: the AdamW kernel on 256 Mi parameters (fp32 master and moments; fp32 gradients,
// or bf16 gradients with a bf16 parameter copy), against a device-to-device copy that moves the
// same bytes through memory (a copy of B/2 bytes reads B/2 and writes B/2), both in the same
// benchmark, timed with CUDA events after warm-up. memcpy_ratio = copy time / AdamW time.
// Needs a GPU; reports an error where there is none.

#include "host/adamw_formula.hpp"
#include "kernels/kernels.hpp"

#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>

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
  const detail::adamw_slabs slabs{reinterpret_cast<float*>(master.data()), reinterpret_cast<float*>(m.data()),  // NOLINT
                                  reinterpret_cast<float*>(v.data()), grad.data(), grad_type,                    // NOLINT
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
  state.counters["bytes_per_s"] = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / (adamw_ms / 1e3);
  state.counters["memcpy_ratio"] = copy_ms / adamw_ms;
  state.SetLabel(std::string(to_string(grad_type)) + " grads" + (copy ? ", bf16 copy" : ""));
}

}  // namespace

BENCHMARK(kernels_adamw)->Arg(static_cast<int>(dtype::f32))->Arg(static_cast<int>(dtype::bf16))
  ->UseManualTime()->Unit(benchmark::kMillisecond);
