// SPDX-License-Identifier: Apache-2.0
// Host benchmarks.
//
// host_adamw/<layout>/<params>/<threads>/<grad dtype>: one AdamW step over `params` parameters
//   (fp32 master and moments; fp32 gradients, or bf16 gradients with a bf16 parameter copy
//   written in the same pass: 28 bytes per parameter either way), on one of two layouts:
//     unit    the runtime's own: the home block of one unit of that size as runtime/units/unit_layout
//             places it in the pinned arena (slabs of 8 MiB and more staggered);
//     packed  the arrays back to back, exactly one array apart (the layout before the stagger,
//             and what a trainer gets cutting them from one block, e.g. 256 MiB apart at 64 Mi
//             params): a caller's layout, which the kernel must not collapse on (layout_ratio,
//             Note [Grouped stores] in host/cpu_adamw_kernel.hpp);
//     packed-lockstep  the same with the stores of the streams interleaved (the plain loop, which
//             staggered slabs run): shown, not a target.
//   Measured in the same run, on separately mapped arrays, each shifted by a different odd number
//   of 1088-byte steps (a layout that cannot share an aliasing pathology with the one judged):
//     anchor_GBps    a STREAM-like kernel with the same 28 B/param of traffic (master, m and v read
//                    and written, the gradients read, the copy written), 256-bit vectors, the same
//                    threads and chunks; it keeps the state finite (v += g * g);
//     AdamW itself on those arrays, with the judged layout's store order (grouped or plain).
//   roofline_ratio = AdamW's bytes/s on the layout over the anchor's (both 28 B/param);
//   layout_ratio   = AdamW on the layout over AdamW on the separate arrays (≥ 0.9 wanted at every
//                    size: a layout that costs more is a collapse). Both are medians of the
//                    ratios within each iteration, which times the three in turn, each pass
//                    starting from caches that hold none of its arrays.
// host_adamw_guarded/<params>/<threads>: a guarded step's AdamW (loss scaling and clipping on)
//   against the plain one, on the same separately mapped arrays in the same iterations (f32
//   gradients, cold caches each time, the order rotating):
//     factors_ratio  AdamW with the step's two gradient factors (1 / scale, the clipping
//                    coefficient) over plain AdamW: the CPU optimizer's whole cost of a guarded
//                    step under host placement, where the square sum runs on the device. Target <= 1.05.
//     check_ratio    the square sum of the gradients (the norm and the non-finite check, as the
//                    emulated device runs it on its CPU) plus that AdamW, over plain AdamW: a
//                    second read of the gradients, shown.
// host_pin: building a 1 GiB arena (bind, parallel pre-fault, page-lock), in GiB/s.
//
// Sizes and threads: the default rows sweep slabs of 1 MiB to 1 GiB (powers of two and sizes
// between) at 1 and 2 threads; TASKSWAP_BENCH_PARAMS=n[,n...] and TASKSWAP_BENCH_THREADS=t[,t...]
// replace the sweep (f32 and bf16 rows at each size then).

#include "host/cpu_adamw.hpp"
#include "host/host_task_arena.hpp"
#include "kernels/kernels.hpp"
#include "runtime/units/unit_layout.hpp"

#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

using namespace taskswap;
using clock_type = std::chrono::steady_clock;
constexpr std::size_t chunk = std::size_t{1} << 16;  // cpu_adamw_step's chunk, for the anchor

enum class layout_kind { unit, packed, packed_lockstep };

std::uint64_t mix(std::uint64_t x)  // splitmix64: a cheap, parallel fill
{
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

float uniform(std::uint64_t i, std::uint64_t salt)  // in [-1, 1)
{
  return static_cast<float>(static_cast<double>(mix(i ^ (salt << 56)) >> 11) * 0x1.0p-52 - 1.0);
}

// Master values in [-1, 1), zero moments, gradients in [-1e-3, 1e-3) as training makes them (no
// subnormals, which would cost microcode assists and time the CPU's slow path).
void fill(const detail::adamw_slabs& s, std::byte* grad, detail::host_task_arena& threads)
{
  threads.parallel_for((s.count + chunk - 1) / chunk, [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first * chunk; i < std::min(s.count, last * chunk); ++i) {
      s.master[i] = uniform(i, 1);
      s.m[i] = 0.0F;
      s.v[i] = 0.0F;
      const float g = std::max(1e-6F, std::abs(uniform(i, 2))) * (i % 2 == 0 ? 1e-3F : -1e-3F);
      if (s.grad_type == dtype::f32) {
        std::memcpy(grad + 4 * i, &g, 4);
      } else {
        const std::uint16_t h = detail::float_to_bf16(g);
        std::memcpy(grad + 2 * i, &h, 2);
      }
    }
  });
}

// The layout judged: one unit's home block (the runtime's placement), or the arrays back to back.
struct judged_layout {
  judged_layout(layout_kind kind, std::size_t n, dtype grad, detail::host_task_arena& threads)
  {
    const dtype compute = grad == dtype::f32 ? dtype::f32 : dtype::bf16;
    if (kind == layout_kind::unit) {
      const unit_spec spec{.name = "bench", .tensors = {{"w", {n}}}, .compute = compute, .grad = grad};
      const detail::unit_layout l = detail::make_unit_layout(spec, optimizer_placement::host);
      arena = std::make_unique<pinned_arena>(dev, pinned_arena_options{.bytes = l.home_bytes});
      std::byte* home = arena->allocate(l.home_bytes).data();
      slabs = l.slabs_at(home, l.home_grads);
      slabs.count = n;
      grads = home + l.home_grads;
    } else {
      const std::size_t f = n * 4;
      const std::size_t h = n * 2;
      const std::size_t bytes = 3 * f + (grad == dtype::f32 ? f : 2 * h);
      arena = std::make_unique<pinned_arena>(dev, pinned_arena_options{.bytes = bytes});
      std::byte* b = arena->allocate(bytes).data();
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): slabs of floats
      slabs = {reinterpret_cast<float*>(b), reinterpret_cast<float*>(b + f),
               // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
               reinterpret_cast<float*>(b + 2 * f), b + 3 * f, grad, grad == dtype::f32 ? nullptr : b + 3 * f + h,
               dtype::bf16, n};
      grads = b + 3 * f;
    }
    fill(slabs, grads, threads);
  }
  device dev = emulated_device({.memory_bytes = 1 << 20});
  std::unique_ptr<pinned_arena> arena;
  detail::adamw_slabs slabs{};
  std::byte* grads = nullptr;
};

// The anchor's memory: every array in its own mapping, shifted by a different odd multiple of
// 1088 bytes, so that no two start a round distance apart whatever the mappings' addresses.
struct separate_arrays {
  separate_arrays(std::size_t n, dtype grad, detail::host_task_arena& threads)
  {
    const auto array = [&](std::size_t bytes) {
      const std::size_t shift = (2 * arenas.size() + 1) * 1088;
      arenas.push_back(std::make_unique<pinned_arena>(dev, pinned_arena_options{.bytes = bytes + shift}));
      return arenas.back()->allocate(bytes + shift).data() + shift;
    };
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): slabs of floats
    slabs.master = reinterpret_cast<float*>(array(n * 4));
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    slabs.m = reinterpret_cast<float*>(array(n * 4));
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    slabs.v = reinterpret_cast<float*>(array(n * 4));
    std::byte* grads = array(n * size_of(grad));
    slabs.grad = grads;
    slabs.grad_type = grad;
    slabs.params = grad == dtype::f32 ? nullptr : array(n * 2);
    slabs.param_type = dtype::bf16;
    slabs.count = n;
    fill(slabs, grads, threads);
  }
  device dev = emulated_device({.memory_bytes = 1 << 20});
  std::vector<std::unique_ptr<pinned_arena>> arenas;
  detail::adamw_slabs slabs{};
};

// 28 bytes per parameter either way: master, m, v read and written; gradients read; the copy written.
std::size_t bytes_per_param(dtype grad) { return 24 + size_of(grad) + (grad == dtype::f32 ? 0 : 2); }

// The anchor kernel: the same arrays in the same directions, a multiply-add or an add per element
// (256-bit vectors: the optimizer's own width or narrower), so that it runs at the memory's speed.
// v grows by g * g, so the state stays finite and AdamW, which runs on the same arrays, stays
// on ordinary numbers.
__attribute__((target("avx2,fma"))) inline void step8(const detail::adamw_slabs& s, std::size_t i, __m256 x)
{
  _mm256_storeu_ps(s.m + i, _mm256_add_ps(_mm256_loadu_ps(s.m + i), x));
  _mm256_storeu_ps(s.v + i, _mm256_fmadd_ps(x, x, _mm256_loadu_ps(s.v + i)));
  _mm256_storeu_ps(s.master + i, _mm256_add_ps(_mm256_loadu_ps(s.master + i), x));
}

__attribute__((target("avx2,fma"))) void stream_like_range(const detail::adamw_slabs& s, std::size_t begin,
                                                           std::size_t end)
{
  std::size_t i = begin;
  if (s.grad_type == dtype::f32) {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): slab of floats
    const auto* g = reinterpret_cast<const float*>(s.grad);
    for (; i + 8 <= end; i += 8) { step8(s, i, _mm256_loadu_ps(g + i)); }
  } else {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): slab of bf16
    const auto* g = reinterpret_cast<const std::uint16_t*>(s.grad);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    auto* copy = reinterpret_cast<std::uint16_t*>(s.params);
    for (; i + 8 <= end; i += 8) {
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
      step8(s, i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(copy + i), h);
    }
  }
  for (; i < end; ++i) {
    s.m[i] += 1e-3F;
    s.v[i] += 1e-6F;
    s.master[i] += 1e-3F;
  }
}

void stream_like(const detail::adamw_slabs& s, detail::host_task_arena& threads)
{
  // The same split over the same threads as cpu_adamw_step.
  threads.parallel_for((s.count + chunk - 1) / chunk, [&](std::size_t first, std::size_t last) {
    stream_like_range(s, first * chunk, std::min(s.count, last * chunk));
  });
}

// Each timed pass starts with caches holding none of its arrays: a pass over a scratch buffer of
// twice the last-level cache (64 MiB at least) evicts them. Without it, at slabs of 1-10 MiB
// (working sets near this VM's 32 MiB L3) whichever pass followed one over the same arrays ran
// from the cache: the separate arrays, shared by the anchor and the AdamW reference, then came
// out 1.2-1.9x faster than the judged layout, for a reason that has nothing to do with the layout.
class cache_evictor {
 public:
  cache_evictor()
  {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    const std::size_t bytes =
      std::max<std::size_t>(std::size_t{64} << 20, l3 > 0 ? 2 * static_cast<std::size_t>(l3) : 0);
    scratch_.assign(bytes / sizeof(std::uint64_t), 1);
  }
  void operator()(detail::host_task_arena& threads)
  {
    const std::size_t n = scratch_.size();
    std::uint64_t* const x = scratch_.data();
    threads.parallel_for((n + chunk - 1) / chunk, [x, n](std::size_t first, std::size_t last) {
      for (std::size_t i = first * chunk; i < std::min(n, last * chunk); ++i) { x[i] += i; }
    });
  }

 private:
  std::vector<std::uint64_t> scratch_;
};

double median(std::vector<double> x)
{
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2), x.end());
  return x[x.size() / 2];
}

template <typename F>
double seconds_of(F&& f)
{
  const auto start = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

// Times the three passes in turn, each from cold caches, starting with a different one each
// iteration (an order effect then averages out); returns their seconds in the passes' order.
template <typename A, typename B, typename C>
std::array<double, 3> three_cold(std::size_t turn, cache_evictor& evict, detail::host_task_arena& threads, A&& a, B&& b,
                                 C&& c)
{
  std::array<double, 3> t{};
  for (std::size_t k = 0; k < 3; ++k) {
    evict(threads);
    switch ((turn + k) % 3) {
      case 0: t[0] = seconds_of(a); break;
      case 1: t[1] = seconds_of(b); break;
      default: t[2] = seconds_of(c); break;
    }
  }
  return t;
}

void host_adamw(benchmark::State& state, layout_kind kind, std::size_t n, int thread_count, dtype grad)
{
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    state.SkipWithError("the roofline anchor needs AVX2 and FMA");
    return;
  }
  detail::host_task_arena threads(-1, thread_count);
  const judged_layout judged(kind, n, grad, threads);
  const separate_arrays separate(n, grad, threads);
  const detail::adamw_scalars scalars = detail::make_adamw_scalars({}, 1);
  const auto judged_step = [&] {
    if (kind == layout_kind::packed_lockstep) {
      detail::cpu_adamw_step(judged.slabs, scalars, threads, detail::best_cpu_isa(), false);
    } else {
      detail::cpu_adamw_step(judged.slabs, scalars, threads);
    }
  };
  // The separate arrays run the same loop as the judged layout (grouped or plain stores, which
  // their own addresses would choose by where mmap put them): layout_ratio compares layouts.
  const bool grouped = kind == layout_kind::packed_lockstep ? false : detail::grouped_stores(judged.slabs);
  const auto separate_step = [&] {
    detail::cpu_adamw_step(separate.slabs, scalars, threads, detail::best_cpu_isa(), grouped);
  };
  judged_step();  // warm-up of each
  separate_step();
  stream_like(separate.slabs, threads);
  // Each iteration times the three in turn, each from cold caches, starting with a different one
  // each time (an order effect then averages out). The figures
  // are medians: the ratios of each iteration's adjacent measurements, which this VM's drifting
  // bandwidth (bursts of +-30 % over a second were seen) affects far less than the means.
  std::vector<double> own;
  std::vector<double> layout_ratio;
  std::vector<double> roofline_ratio;
  std::size_t turn = 0;
  cache_evictor evict;
  for (auto _ : state) {
    const std::array<double, 3> t =
      three_cold(turn, evict, threads, judged_step, separate_step, [&] { stream_like(separate.slabs, threads); });
    ++turn;
    state.SetIterationTime(t[0]);
    own.push_back(t[0]);
    layout_ratio.push_back(t[1] / t[0]);
    roofline_ratio.push_back(t[2] / t[0]);
  }
  const double per_step = median(own);
  const double bytes = static_cast<double>(n * bytes_per_param(grad));
  for (const float x : {separate.slabs.master[n / 3], separate.slabs.v[n / 3], judged.slabs.master[n / 3]}) {
    if (!std::isfinite(x)) { state.SkipWithError("the state is not finite after the run: the rows would time NaN"); }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["params_per_s"] = static_cast<double>(n) / per_step;
  state.counters["anchor_GBps"] = bytes / (per_step * median(roofline_ratio)) / 1e9;
  state.counters["roofline_ratio"] = median(roofline_ratio);
  state.counters["layout_ratio"] = median(layout_ratio);
  state.counters["threads"] = threads.concurrency();
  state.SetLabel(std::string(detail::to_string(detail::best_cpu_isa())));
}

void host_adamw_guarded(benchmark::State& state, std::size_t n, int thread_count)
{
  detail::host_task_arena threads(-1, thread_count);
  const separate_arrays arrays(n, dtype::f32, threads);
  const detail::adamw_scalars plain = detail::make_adamw_scalars({}, 1);
  detail::adamw_scalars guarded = plain;
  guarded.grad_unscale = 1.0F / 1024.0F;
  guarded.grad_clip = 0.5F;
  const auto square_sum = [&] {
    detail::step_guard g;
    g.scale = 1024.0F;
    detail::host_square_sum(arrays.slabs.grad, dtype::f32, n, g);
    benchmark::DoNotOptimize(g.square_sum);
  };
  detail::cpu_adamw_step(arrays.slabs, plain, threads);  // warm-up of each
  detail::cpu_adamw_step(arrays.slabs, guarded, threads);
  square_sum();
  std::vector<double> own;
  std::vector<double> factors_ratio;
  std::vector<double> check_ratio;
  std::size_t turn = 0;
  cache_evictor evict;
  for (auto _ : state) {
    const std::array<double, 3> t = three_cold(
      turn, evict, threads, [&] { detail::cpu_adamw_step(arrays.slabs, plain, threads); },
      [&] { detail::cpu_adamw_step(arrays.slabs, guarded, threads); }, square_sum);
    ++turn;
    state.SetIterationTime(t[1]);
    own.push_back(t[1]);
    factors_ratio.push_back(t[1] / t[0]);
    check_ratio.push_back((t[1] + t[2]) / t[0]);
  }
  if (!std::isfinite(arrays.slabs.master[n / 3])) { state.SkipWithError("the state is not finite after the run"); }
  state.SetBytesProcessed(static_cast<std::int64_t>(n * bytes_per_param(dtype::f32)) * state.iterations());
  state.counters["params_per_s"] = static_cast<double>(n) / median(own);
  state.counters["factors_ratio"] = median(factors_ratio);
  state.counters["check_ratio"] = median(check_ratio);
  state.counters["threads"] = threads.concurrency();
  state.SetLabel(std::string(detail::to_string(detail::best_cpu_isa())) + ", square sum single-threaded");
}

std::vector<std::size_t> list_from_env(const char* name, std::vector<std::size_t> fallback)
{
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') { return fallback; }
  std::vector<std::size_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) { out.push_back(std::stoull(item)); }
  return out;
}

std::string size_name(std::size_t n)
{
  if (n % (std::size_t{1} << 20) == 0) { return std::to_string(n >> 20) + "Mi"; }
  if (n % (std::size_t{1} << 10) == 0) { return std::to_string(n >> 10) + "Ki"; }
  return std::to_string(n);
}

// The rows: slabs of 1 MiB to 1 GiB (params = slab bytes / 4), powers of two and the sizes between,
// on both layouts at 1 and 2 threads with f32 gradients; bf16 rows at 64 Mi. Each row runs about
// 32 GB of AdamW traffic (at least 9 iterations, at most 300) (three times that with the separate arrays and the anchor).
[[maybe_unused]] const bool registered = [] {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> mib{1, 3, 8, 24, 64, 96, 128, 192, 256, 384, 512, 768, 1024};
  for (const std::size_t m : mib) { sizes.push_back(m << 18); }
  const bool chosen = std::getenv("TASKSWAP_BENCH_PARAMS") != nullptr;
  sizes = list_from_env("TASKSWAP_BENCH_PARAMS", sizes);
  const std::vector<std::size_t> thread_counts = list_from_env("TASKSWAP_BENCH_THREADS", {1, 2});
  for (const std::size_t n : sizes) {
    for (const std::size_t t : thread_counts) {
      for (const dtype grad : {dtype::f32, dtype::bf16}) {
        if (grad == dtype::bf16 && !chosen && n != (std::size_t{64} << 20)) { continue; }
        for (const layout_kind kind : {layout_kind::unit, layout_kind::packed, layout_kind::packed_lockstep}) {
          const std::string name = std::string("host_adamw/") +
                                   (kind == layout_kind::unit     ? "unit/"
                                    : kind == layout_kind::packed ? "packed/"
                                                                  : "packed-lockstep/") +
                                   size_name(n) + "/" + std::to_string(t) + "t/" + std::string(to_string(grad));
          const auto iterations = static_cast<benchmark::IterationCount>(
            std::clamp<double>(32e9 / static_cast<double>(n * bytes_per_param(grad)), 9, 300));
          benchmark::RegisterBenchmark(name.c_str(), host_adamw, kind, n, static_cast<int>(t), grad)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(iterations);
        }
      }
    }
  }
  // Guarded rows: slabs of 4 MiB to 256 MiB (params = bytes / 4), at 1 and 2 threads.
  const std::vector<std::size_t> guarded_sizes =
    chosen ? sizes
           : std::vector<std::size_t>{std::size_t{1} << 20, std::size_t{6} << 20, std::size_t{24} << 20,
                                      std::size_t{64} << 20};
  for (const std::size_t n : guarded_sizes) {
    for (const std::size_t t : thread_counts) {
      const std::string name = std::string("host_adamw_guarded/") + size_name(n) + "/" + std::to_string(t) + "t";
      const auto iterations =
        static_cast<benchmark::IterationCount>(std::clamp<double>(16e9 / static_cast<double>(n * 28), 9, 300));
      benchmark::RegisterBenchmark(name.c_str(), host_adamw_guarded, n, static_cast<int>(t))
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(iterations);
    }
  }
  return true;
}();

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

BENCHMARK(host_pin)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(3);
