// SPDX-License-Identifier: Apache-2.0
// Host benchmarks.
//
// host_adamw: one AdamW step over 64 Mi parameters in the pinned arena (fp32 master and moments;
//   fp32 gradients, or bf16 gradients with a bf16 parameter copy written in the same pass). The
//   anchor, measured in the same benchmark, is a STREAM-style kernel with the same access pattern
//   (the same arrays read and written, one add per element) and the same threads, timed in every
//   iteration beside AdamW. roofline_ratio = AdamW bytes/s over the anchor's bytes/s (mean over the
//   iterations), counting 28 bytes per parameter in both cases.
// host_pin: building a 1 GiB arena (bind, parallel pre-fault, page-lock), in GiB/s.

#include "host/cpu_adamw.hpp"
#include "host/host_task_arena.hpp"

#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <immintrin.h>
#include <cstring>
#include <random>

namespace {

using namespace taskswap;
using clock_type = std::chrono::steady_clock;
constexpr std::size_t params = std::size_t{64} << 20;
constexpr std::size_t chunk = std::size_t{1} << 16;

struct adamw_unit {
  adamw_unit(pinned_arena& arena, dtype grad) : grad_type(grad)
  {
    master = reinterpret_cast<float*>(arena.allocate(params * 4).data());  // NOLINT: slab of floats
    m = reinterpret_cast<float*>(arena.allocate(params * 4).data());       // NOLINT
    v = reinterpret_cast<float*>(arena.allocate(params * 4).data());       // NOLINT
    g = arena.allocate(params * size_of(grad)).data();
    if (grad == dtype::bf16) { copy = arena.allocate(params * 2).data(); }
    std::mt19937 gen{5};
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (std::size_t i = 0; i < params; ++i) {
      master[i] = normal(gen);
      m[i] = 0.0F;
      v[i] = 0.0F;
    }
    // Gradients as training makes them: normal, about 1e-3 (no subnormals, which would cost
    // microcode assists in g * g and measure the CPU's slow path instead of the optimizer).
    std::normal_distribution<float> gradient(0.0F, 1e-3F);
    for (std::size_t i = 0; i < params; ++i) {
      const float x = gradient(gen);
      if (grad == dtype::f32) {
        std::memcpy(g + 4 * i, &x, 4);
      } else {
        const std::uint16_t h = detail::float_to_bf16(x);
        std::memcpy(g + 2 * i, &h, 2);
      }
    }
  }
  detail::adamw_slabs slabs() const
  {
    return {master, m, v, g, grad_type, copy, dtype::bf16, params};
  }
  // Bytes one pass moves: master, m, v read and written; gradients read; the copy written.
  [[nodiscard]] std::size_t bytes() const
  {
    return params * (24 + size_of(grad_type) + (copy != nullptr ? 2 : 0));
  }
  dtype grad_type;
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::byte* g = nullptr;
  std::byte* copy = nullptr;
};

// The anchor: the same arrays in the same directions, one add per element, with 256-bit vectors
// (the optimizer's own vector width or narrower), so that it runs at the memory's speed.
__attribute__((target("avx2"))) void stream_like_range(const adamw_unit& u, std::size_t begin, std::size_t end)
{
  std::size_t i = begin;
  if (u.grad_type == dtype::f32) {
    const auto* g = reinterpret_cast<const float*>(u.g);  // NOLINT: slab of floats
    for (; i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      _mm256_storeu_ps(u.m + i, _mm256_add_ps(_mm256_loadu_ps(u.m + i), x));
      _mm256_storeu_ps(u.v + i, _mm256_add_ps(_mm256_loadu_ps(u.v + i), x));
      _mm256_storeu_ps(u.master + i, _mm256_add_ps(_mm256_loadu_ps(u.master + i), x));
    }
  } else {
    const auto* g = reinterpret_cast<const std::uint16_t*>(u.g);  // NOLINT: slab of bf16
    auto* copy = reinterpret_cast<std::uint16_t*>(u.copy);        // NOLINT
    for (; i + 8 <= end; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));  // NOLINT
      const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      _mm256_storeu_ps(u.m + i, _mm256_add_ps(_mm256_loadu_ps(u.m + i), x));
      _mm256_storeu_ps(u.v + i, _mm256_add_ps(_mm256_loadu_ps(u.v + i), x));
      _mm256_storeu_ps(u.master + i, _mm256_add_ps(_mm256_loadu_ps(u.master + i), x));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(copy + i), h);  // NOLINT
    }
  }
  for (; i < end; ++i) {  // params is a multiple of 8; kept for other sizes
    u.m[i] += 1.0F;
    u.v[i] += 1.0F;
    u.master[i] += 1.0F;
  }
}

void stream_like(const adamw_unit& u, detail::host_task_arena& arena)
{
  // The same split over the same threads as cpu_adamw_step.
  arena.parallel_for((params + chunk - 1) / chunk, [&](std::size_t first, std::size_t last) {
    stream_like_range(u, first * chunk, std::min(params, last * chunk));
  });
}

template <typename F>
double seconds_of(F&& f)
{
  const auto start = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

void host_adamw(benchmark::State& state)
{
  if (!__builtin_cpu_supports("avx2")) {
    state.SkipWithError("the roofline anchor needs AVX2");
    return;
  }
  const auto grad = static_cast<dtype>(state.range(0));
  const device dev = emulated_device({.memory_bytes = 1 << 20});
  pinned_arena arena(dev, {.bytes = params * 20});
  detail::host_task_arena threads(static_cast<int>(arena.numa_node()), 0);
  const adamw_unit unit(arena, grad);
  const detail::adamw_scalars k = detail::make_adamw_scalars({}, 1);
  // Warm-up, then AdamW and the anchor in turn in every iteration, so both see the same machine
  // (this VM's memory bandwidth drifts by several percent over seconds).
  detail::cpu_adamw_step(unit.slabs(), k, threads);
  stream_like(unit, threads);
  double total = 0.0;
  double anchor_total = 0.0;
  for (auto _ : state) {
    const double t = seconds_of([&] { detail::cpu_adamw_step(unit.slabs(), k, threads); });
    state.SetIterationTime(t);
    total += t;
    anchor_total += seconds_of([&] { stream_like(unit, threads); });
  }
  const double anchor = anchor_total / static_cast<double>(state.iterations());
  const double per_step = total / static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(unit.bytes()) * state.iterations());
  state.counters["params_per_s"] = static_cast<double>(params) / per_step;
  state.counters["roofline_ratio"] = anchor / per_step;
  state.counters["anchor_GBps"] = static_cast<double>(unit.bytes()) / anchor / 1e9;
  state.counters["threads"] = threads.concurrency();
  state.SetLabel(std::string(to_string(grad)) + " grads, " + std::string(detail::to_string(detail::best_cpu_isa())));
}

void host_pin(benchmark::State& state)
{
  const device dev = emulated_device({.memory_bytes = 1 << 20});
  const std::size_t bytes = std::size_t{1} << 30;
  for (auto _ : state) {
    const double t = seconds_of([&] { pinned_arena arena(dev, {.bytes = bytes, .lock_pages = true}); });
    state.SetIterationTime(t);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

}  // namespace

BENCHMARK(host_adamw)->Arg(static_cast<int>(dtype::f32))->Arg(static_cast<int>(dtype::bf16))
  ->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK(host_pin)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(3);
