// SPDX-License-Identifier: Apache-2.0
// The device pool against the contiguous pool it replaced, on the same swapping sequence.
//
// device_pool_swap/{granule, 0 for CUDA}: 64 units of sizes spread log-uniformly over three orders of magnitude
// (1 KiB to 1 MiB) take turns in a budget that holds about a quarter of them, round robin with a
// seeded shuffle: each turn evicts the least recently placed units until the next one fits, then
// places it. Timed: the host time per placement, evictions included.
//   - new: the granule pool (runtime/pool/device_pool): a unit fits when the free granules hold it.
//   - old: best-fit ranges over one allocation (device/best_fit_ranges, the pool before DESIGN
//     invariant 8): a unit fits when one free block holds it, so split room costs evictions the
//     sum would not need (counted: extra_evictions_old).
//   ratio = new / old. Target for the runtime's swapping rows: ≤ 1.10; this isolates the
//   pool's part of them. At a 4 KiB granule the emulated device maps a memory file (a system call
//   when a slot moves); at 256 bytes it only counts, as the emulated default does.
//
// cuda_vmm_move/{MiB}/{busy}/{per granule}: what moving a slot to other memory costs the thread that
// maps on a CUDA device: the backend's vm_map (cuMemMap, cuMemSetAccess) and vm_unmap of MiB at one
// address, then at another, timed on the host (us_per_move: the mean of the two), the MiB one
// handle (per granule = 0, the device pool's extents) or a handle per granule (1); with
// busy = 1 while a 1 GiB host-to-device copy (copy_ms, about 20 ms) runs on another stream into
// VMM-mapped memory, as the runtime's swap-ins do. copying_after_map = the share of turns in which
// that copy was still running right after the first vm_map: near 1 where the calls leave the
// device's work alone; near 0 where a call waits for it (then the turn's time holds the copy's
// remainder). bench/vmm_probe.cu splits the same costs by call.

#include "device/backend.hpp"
#include "device/best_fit_ranges.hpp"
#include "runtime/pool/device_pool.hpp"

#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <optional>
#include <random>
#include <vector>

namespace {

using namespace taskswap;
using clock_type = std::chrono::steady_clock;

struct workload {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> order;  // which unit each turn places
  std::size_t budget = 0;
};

workload make_workload(std::size_t granule)
{
  std::mt19937_64 rng(19);
  workload w;
  std::size_t total = 0;
  for (int i = 0; i < 64; ++i) {
    const double bytes = 1024.0 * std::pow(1024.0, std::uniform_real_distribution<>(0.0, 1.0)(rng));
    w.sizes.push_back(static_cast<std::size_t>(bytes) / 256 * 256 + 256);
    total += (w.sizes.back() + granule - 1) / granule * granule;
  }
  w.budget = std::max(total / 4, *std::max_element(w.sizes.begin(), w.sizes.end()) * 2) / granule * granule + granule;
  std::vector<std::size_t> round(64);
  for (std::size_t i = 0; i < 64; ++i) { round[i] = i; }
  for (int r = 0; r < 64; ++r) {
    std::shuffle(round.begin(), round.end(), rng);
    w.order.insert(w.order.end(), round.begin(), round.end());
  }
  return w;
}

// Both pools behind one loop: place(unit) → bool, evict(unit).
template <typename Place, typename Evict>
double run_turns(const workload& w, Place place, Evict evict, std::size_t& evictions)
{
  std::deque<std::size_t> live;  // placement order
  std::vector<bool> resident(w.sizes.size(), false);
  const auto start = clock_type::now();
  for (const std::size_t u : w.order) {
    if (resident[u]) { continue; }
    while (!place(u)) {
      const std::size_t victim = live.front();
      live.pop_front();
      evict(victim);
      resident[victim] = false;
      ++evictions;
    }
    live.push_back(u);
    resident[u] = true;
  }
  const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  for (const std::size_t u : live) { evict(u); }
  return seconds;
}

void device_pool_swap(benchmark::State& state)
{
  const bool cuda = state.range(0) == 0;
  if (cuda && cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t granule = cuda ? cuda_device(0).granularity() : static_cast<std::size_t>(state.range(0));
  const workload w = make_workload(granule);
  const device dev =
    cuda ? cuda_device(0) : emulated_device({.memory_bytes = 2 * w.budget, .link = {}, .granularity = granule});

  detail::device_pool pool(dev, w.budget);
  std::vector<detail::device_pool::slot_id> slots;
  for (const std::size_t bytes : w.sizes) { slots.push_back(pool.add_slot(bytes)); }
  // Nothing runs on the device here.
  const auto quiesce = [](detail::device_pool::slot_id, stream_view) { return std::string(); };
  device_buffer region(dev, w.budget);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): alignment
  detail::best_fit_ranges ranges(w.budget, reinterpret_cast<std::uintptr_t>(region.data()));
  std::vector<std::size_t> offsets(w.sizes.size());

  double new_seconds = 0;
  double old_seconds = 0;
  std::size_t new_evictions = 0;
  std::size_t old_evictions = 0;
  std::size_t turns = 0;
  for (auto _ : state) {
    old_seconds += run_turns(
      w,
      [&](std::size_t u) {
        const auto at = ranges.allocate(w.sizes[u], 256);
        if (at) { offsets[u] = *at; }
        return at.has_value();
      },
      [&](std::size_t u) { static_cast<void>(ranges.deallocate(offsets[u], w.sizes[u])); }, old_evictions);
    const double t = run_turns(
      w, [&](std::size_t u) { return pool.try_map(slots[u], w.sizes[u], 0, quiesce).has_value(); },
      [&](std::size_t u) { pool.unmap(slots[u]); }, new_evictions);
    new_seconds += t;
    turns += w.order.size();
    state.SetIterationTime(t);
  }
  const auto n = static_cast<double>(turns);
  state.counters["ns_per_turn_new"] = new_seconds / n * 1e9;
  state.counters["ns_per_turn_old"] = old_seconds / n * 1e9;
  state.counters["ratio"] = new_seconds / old_seconds;
  state.counters["evictions_new"] = static_cast<double>(new_evictions) / static_cast<double>(state.iterations());
  state.counters["extra_evictions_old"] =
    (static_cast<double>(old_evictions) - static_cast<double>(new_evictions)) / static_cast<double>(state.iterations());
}

void cuda_vmm_move(benchmark::State& state)
{
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device: this benchmark needs a GPU (tools/gpu-check)");
    return;
  }
  const device dev = cuda_device(0);
  detail::backend& b = dev.backend();
  const std::size_t g = b.vm_granularity();
  const std::size_t granules = (static_cast<std::size_t>(state.range(0)) << 20) / g;
  if (granules == 0) {
    state.SkipWithError("the row is smaller than one granule of this device");
    return;
  }
  const bool busy = state.range(1) != 0;
  const bool per_granule = state.range(2) != 0;
  constexpr std::size_t copy_bytes = std::size_t{1} << 30;
  const std::size_t copy_granules = (copy_bytes + g - 1) / g;
  // Every resource the benchmark takes, given back however it ends: `pieces` handles of `granules`
  // in all, mapped one after another.
  struct vm_area {
    detail::backend& b;
    std::size_t granules;
    std::size_t g;
    std::vector<void*> handles;
    std::byte* va = nullptr;
    std::byte* second = nullptr;
    bool mapped = false;
    vm_area(detail::backend& backend, std::size_t n, std::size_t granule, std::size_t pieces)
        : b(backend), granules(n), g(granule)
    {
      for (std::size_t i = 0; i < pieces; ++i) { handles.push_back(b.vm_create(granules / pieces)); }
      va = b.vm_reserve(granules * g);
      second = b.vm_reserve(granules * g);
    }
    vm_area(const vm_area&) = delete;
    vm_area& operator=(const vm_area&) = delete;
    ~vm_area()
    {
      if (mapped) { b.vm_unmap(va, granules); }
      b.vm_free(va, granules * g);
      b.vm_free(second, granules * g);
      for (void* h : handles) { b.vm_release(h, granules / handles.size()); }
    }
    void map(std::byte* at)
    {
      const std::size_t each = granules / handles.size();
      for (std::size_t i = 0; i < handles.size(); ++i) { b.vm_map(at + i * each * g, handles[i], each); }
    }
  };
  vm_area moved(b, granules, g, per_granule ? granules : 1);
  std::optional<vm_area> target;  // the copy's destination, mapped as the pool maps a slot
  std::optional<pinned_buffer> source;
  if (busy) {
    target.emplace(b, copy_granules, g, 1);
    target->map(target->va);
    target->mapped = true;
    source.emplace(dev, copy_bytes);
  }
  stream copies(dev);
  double seconds = 0;
  double copy_seconds = 0;
  std::size_t turns = 0;
  std::size_t copying = 0;
  for (auto _ : state) {
    std::optional<event> start;
    std::optional<event> end;
    if (busy) {
      start.emplace(dev, event_options{.timing = true});
      end.emplace(dev, event_options{.timing = true});
      start->record(copies);
      copy_async(device_span(&b, target->va, copy_bytes), source->span(), copies);
      end->record(copies);
    }
    const auto t0 = clock_type::now();
    for (std::byte* va : {moved.va, moved.second}) {
      moved.map(va);
      if (busy && va == moved.va && !copies.query()) { ++copying; }  // right after the first map
      b.vm_unmap(va, granules);
    }
    const double t = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (busy) {
      end->synchronize();
      copy_seconds += elapsed_ms(*start, *end) / 1e3;
    }
    state.SetIterationTime(t);
    seconds += t;
    turns += 2;
  }
  const auto iterations = static_cast<double>(state.iterations());
  state.counters["us_per_move"] = seconds / static_cast<double>(turns) * 1e6;
  state.counters["copy_ms"] = busy ? copy_seconds / iterations * 1e3 : 0.0;
  state.counters["copying_after_map"] = busy ? static_cast<double>(copying) / iterations : 0.0;
}

}  // namespace

// Emulated at 256 B, 4 KiB and 64 KiB granules; 0: the CUDA device at its own granule (skipped without one).
BENCHMARK(device_pool_swap)
  ->Arg(256)
  ->Arg(4096)
  ->Arg(64 << 10)
  ->Arg(0)
  ->UseManualTime()
  ->Unit(benchmark::kMicrosecond)
  ->MinTime(0.5);
// 2, 64 and 192 MiB (1, 32 and 96 granules of 2 MiB), the device idle and busy copying, in one
// handle (the pool's extents) and in a handle per granule (the pool before them).
BENCHMARK(cuda_vmm_move)
  ->ArgsProduct({{2, 64, 192}, {0, 1}, {0, 1}})
  ->UseManualTime()
  ->Unit(benchmark::kMicrosecond)
  ->Iterations(20);
