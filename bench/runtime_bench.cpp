// SPDX-License-Identifier: Apache-2.0
// Runtime benchmarks.
//
// runtime_acquire_release: host time of one acquire + release (all hits: the plan runs ahead)
//   with 1,000 and 10,000 registered units; us_per_op. Target ≤ 5 µs (DESIGN.md). With a budget
//   for 64 units the calls also issue a step's eviction and prefetch (four stream operations).
// runtime_overlap: a training loop over task units that do not all fit, on the emulated device
//   with a 5 GB/s link, against the same loop with every unit resident, in the same run.
//   Each step acquires one task unit, "computes" for compute_factor × the step's transfer time
//   (a host function that sleeps on the compute stream, so it costs no CPU), runs AdamW on the
//   device, and releases it; swapping moves the unit's parameters and moments both ways.
//   step_time_ratio = step time swapping / step time all-resident. Target ≤ 1.03.
// runtime_streaming: a streamed trunk's step time against all-resident (see the function).
// runtime_streaming/h200/{elements}/{layers}/{compute %}/{room}: the same on the emulated h200,
//   layers of {elements} f32 parameters.
// cuda_runtime_streaming: the same on a CUDA device (see the function).
// cuda_runtime_overlap: the same loop on a CUDA device, the step's transfer time measured as a
//   plain duplex cudaMemcpyAsync between pinned_buffers and device buffers; at compute 0,
//   link_ratio = the runtime's swap rate / that copy's rate.
// runtime_overlap/h200/{elements}/{compute %}: cuda_runtime_overlap's rows on the emulated device
//   under the h200 profile (an H200's link and its driver's mapping costs, slowed 104 times), the
//   anchor a plain duplex copy on the same emulated link. Targets: link_ratio ≥ 0.9 at compute 0,
//   step_time_ratio ≤ 1.03 at 125. map_work_over_model: whether this host keeps up with the
//   profile (h200_time_scale).
// TASKSWAP_BENCH_TRACE=<file>: the overlap and streaming rows write the swapping runtime's trace
//   there (Chrome JSON; the last row run), for looking at where a step's time goes.
//   Only the swapping runtime records spans, so a traced run's step_time_ratio is not comparable.

#include <taskswap/taskswap.hpp>

#include "device/backend.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <thread>
#include <vector>

namespace {

using namespace taskswap;
using clock_type = std::chrono::steady_clock;

unit_spec task_unit(std::size_t index, std::size_t elements, residency r, int lookahead)
{
  unit_spec u;
  u.name = "task/" + std::to_string(index);
  u.tensors = {{"w", {elements}}};
  u.policy = unit_policy{r, lookahead, optimizer_placement::device};
  return u;
}

void runtime_acquire_release(benchmark::State& state)
{
  const auto units = static_cast<std::size_t>(state.range(0));
  const auto resident_units = static_cast<std::size_t>(state.range(1));
  constexpr std::size_t elements = 256;  // 4 KiB per unit on the device
  std::vector<unit_spec> specs;
  for (std::size_t i = 0; i < units; ++i) { specs.push_back(task_unit(i, elements, residency::prefetch, 2)); }
  runtime_options options;
  options.device.budget = resident_units * 4 * elements * sizeof(float);
  const device dev = emulated_device({.memory_bytes = options.device.budget, .link = {}});
  runtime rt(dev, options, specs);
  stream s(dev);
  std::size_t next_planned = 0;
  const auto plan_ahead = [&](std::size_t upto) {
    for (; next_planned < upto; ++next_planned) {
      rt.plan(step_plan{unit_id{static_cast<std::uint32_t>(next_planned % units)}});
    }
  };
  plan_ahead(8);
  std::size_t k = 0;
  std::size_t ops = 0;
  double seconds = 0;
  for (auto _ : state) {
    plan_ahead(k + 8);
    const unit_id u{static_cast<std::uint32_t>(k % units)};
    const auto begin = clock_type::now();
    const unit_view v = rt.acquire(u, s);
    rt.release(u, s);
    const auto end = clock_type::now();
    benchmark::DoNotOptimize(v.params.data);
    (void)rt.end_step();
    if (++k % 1024 == 0) { s.synchronize(); }  // keep the emulated queues short
    const double t = std::chrono::duration<double>(end - begin).count();
    state.SetIterationTime(t);
    seconds += t;
    ++ops;
  }
  s.synchronize();
  const runtime_stats st = rt.stats();
  state.counters["us_per_op"] = seconds / static_cast<double>(std::max<std::size_t>(ops, 1)) * 1e6;
  state.counters["misses"] = static_cast<double>(st.total.misses);
}

// One training loop: `steps` steps, each on the next task of a seeded round-robin, planned
// `lookahead + 2` steps ahead. Returns the wall time of the steps, the device idle at both ends.
struct loop_result {
  double seconds = 0;
  step_stats totals{};
};

// A loop's wall time and the runtime's figures since `before` (the peak: the run's so far).
loop_result result_since(const runtime& rt, const runtime_stats& before, double seconds)
{
  loop_result r;
  r.seconds = seconds;
  const runtime_stats after = rt.stats();
  r.totals.h2d_bytes = after.total.h2d_bytes - before.total.h2d_bytes;
  r.totals.d2h_bytes = after.total.d2h_bytes - before.total.d2h_bytes;
  r.totals.stall_ms = after.total.stall_ms - before.total.stall_ms;
  r.totals.misses = after.total.misses - before.total.misses;
  r.totals.peak_device_bytes = after.total.peak_device_bytes;
  return r;
}

loop_result train(runtime& rt, stream& s, std::size_t tasks, std::size_t steps, std::chrono::microseconds compute,
                  std::size_t& next_planned, std::size_t& next_step)
{
  const auto task_of = [&](std::size_t k) { return unit_id{static_cast<std::uint32_t>((k * 5 + k / tasks) % tasks)}; };
  const auto plan_ahead = [&](std::size_t upto) {
    for (; next_planned < upto; ++next_planned) { rt.plan(step_plan{task_of(next_planned)}); }
  };
  const runtime_stats before = rt.stats();
  rt.flush();
  s.synchronize();
  const auto begin = clock_type::now();
  for (std::size_t i = 0; i < steps; ++i, ++next_step) {
    plan_ahead(next_step + 4);
    const unit_id u = task_of(next_step);
    (void)rt.acquire(u, s);
    launch_host_func(s, [compute] { std::this_thread::sleep_for(compute); });
    rt.step(u, s);
    rt.release(u, s);
    (void)rt.end_step();
  }
  s.synchronize();
  const auto end = clock_type::now();
  return result_since(rt, before, std::chrono::duration<double>(end - begin).count());
}

// The fastest of three timed rounds of `work` (queued on `s` between two timing events) after a
// warm-up round, in seconds: a plain copy's time, the anchor the runtime's rows are judged by.
template <class Work>
double fastest_round(const device& dev, stream& s, const Work& work)
{
  double best = 0;
  for (int round = 0; round < 4; ++round) {
    event start(dev, {.timing = true});
    event end(dev, {.timing = true});
    start.record(s);
    work();
    end.record(s);
    end.synchronize();
    const double seconds = elapsed_ms(start, end) / 1e3;
    if (round == 1 || (round > 1 && seconds < best)) { best = seconds; }
  }
  return best;
}

// One timed plain duplex copy of `bytes` each way between pinned_buffers (not the runtime's
// arena) and device buffers on two streams: the link's rate without the runtime, in seconds.
double plain_duplex_seconds(const device& dev, std::size_t bytes)
{
  pinned_buffer host_in(dev, bytes);
  pinned_buffer host_out(dev, bytes);
  device_buffer device_in(dev, bytes);
  device_buffer device_out(dev, bytes);
  stream up(dev);
  stream down(dev);
  return fastest_round(dev, up, [&] {
    event started(dev);
    event down_done(dev);
    started.record(up);
    started.wait(down);
    copy_async(device_in.span(), host_in.span(), up);
    copy_async(host_out.span(), device_out.span(), down);
    down_done.record(down);
    down_done.wait(up);
  });
}

// The overlap loop on two runtimes of `tasks` units of `elements` f32 each: one swapping in a budget
// of three units, one with every unit resident. `transfer` is one step's transfer time on the link
// (one unit in and one out at once); compute is compute_factor × transfer.
void overlap(benchmark::State& state, const device& swapped_dev, const device& resident_dev, std::size_t elements,
             std::chrono::duration<double> transfer)
{
  constexpr std::size_t tasks = 8;
  constexpr std::size_t steps = 24;
  const double compute_factor = static_cast<double>(state.range(1)) / 100.0;
  // Swapping: room for three units (the step's, and two on their way in or out).
  std::vector<unit_spec> swapped_specs;
  std::vector<unit_spec> resident_specs;
  for (std::size_t i = 0; i < tasks; ++i) {
    swapped_specs.push_back(task_unit(i, elements, residency::prefetch, 1));
    resident_specs.push_back(task_unit(i, elements, residency::pinned, 1));
  }
  const std::size_t unit_bytes = 4 * elements * sizeof(float);  // params, m, v, grads (f32)
  runtime_options swapped_options;
  swapped_options.device.budget = 3 * unit_bytes;
  const char* const trace = std::getenv("TASKSWAP_BENCH_TRACE");
  swapped_options.trace = trace != nullptr;
  runtime_options resident_options;
  resident_options.device.budget = tasks * unit_bytes;
  runtime swapped(swapped_dev, swapped_options, swapped_specs);
  runtime resident(resident_dev, resident_options, resident_specs);
  stream swapped_stream(swapped_dev);
  stream resident_stream(resident_dev);

  const auto compute = std::chrono::duration_cast<std::chrono::microseconds>(transfer * compute_factor);
  std::size_t swapped_planned = 0, swapped_step = 0, resident_planned = 0, resident_step = 0;
  (void)train(swapped, swapped_stream, tasks, tasks, compute, swapped_planned, swapped_step);  // warm-up
  (void)train(resident, resident_stream, tasks, tasks, compute, resident_planned, resident_step);

  double swapped_seconds = 0, resident_seconds = 0, stall_ms = 0;
  std::size_t h2d = 0, d2h = 0, misses = 0;
  for (auto _ : state) {
    const loop_result a = train(resident, resident_stream, tasks, steps, compute, resident_planned, resident_step);
    const loop_result b = train(swapped, swapped_stream, tasks, steps, compute, swapped_planned, swapped_step);
    resident_seconds += a.seconds;
    swapped_seconds += b.seconds;
    stall_ms += b.totals.stall_ms;
    h2d += b.totals.h2d_bytes;
    d2h += b.totals.d2h_bytes;
    misses += b.totals.misses;
    state.SetIterationTime(b.seconds);
  }
  if (trace != nullptr) { swapped.write_trace(trace); }
  const double n = static_cast<double>(state.iterations()) * static_cast<double>(steps);
  state.counters["step_time_ratio"] = swapped_seconds / resident_seconds;
  state.counters["step_ms_swapped"] = swapped_seconds / n * 1e3;
  state.counters["step_ms_resident"] = resident_seconds / n * 1e3;
  state.counters["transfer_ms"] = transfer.count() * 1e3;
  state.counters["compute_ms"] = static_cast<double>(compute.count()) / 1e3;
  state.counters["stall_ms_per_step"] = stall_ms / n;
  state.counters["h2d_MiB_per_step"] = static_cast<double>(h2d) / n / (1 << 20);
  state.counters["d2h_MiB_per_step"] = static_cast<double>(d2h) / n / (1 << 20);
  state.counters["misses"] = static_cast<double>(misses);
}

void runtime_overlap(benchmark::State& state)
{
  constexpr double link = 5e9;
  const auto elements = static_cast<std::size_t>(state.range(0));
  const std::size_t unit_bytes = 4 * elements * sizeof(float);
  const auto dev = [&](std::size_t units) {
    return emulated_device({.memory_bytes = units * unit_bytes, .link = {.bytes_per_second = link}});
  };
  // Per step: one unit in and one out, on separate directions of the link.
  const std::size_t travel = 3 * elements * sizeof(float);
  overlap(state, dev(3), dev(8), elements, std::chrono::duration<double>(static_cast<double>(travel) / link));
}

// The overlap loop with its anchor measured on the device itself: the step's transfer time is a
// plain duplex copy of the bytes a step moves between pinned_buffers and device buffers
// (link_ratio = swapped bytes per second / the anchor's, read at compute 0).
void anchored_overlap(benchmark::State& state, const device& swapped_dev, const device& resident_dev)
{
  const auto elements = static_cast<std::size_t>(state.range(0));
  const std::size_t travel = 3 * elements * sizeof(float);
  const double transfer = plain_duplex_seconds(swapped_dev, travel);
  overlap(state, swapped_dev, resident_dev, elements, std::chrono::duration<double>(transfer));
  const double moved =
    (state.counters["h2d_MiB_per_step"].value + state.counters["d2h_MiB_per_step"].value) * (1 << 20);
  state.counters["swap_GBps"] = moved / (state.counters["step_ms_swapped"].value / 1e3) / 1e9;
  state.counters["anchor_GBps"] = 2.0 * static_cast<double>(travel) / transfer / 1e9;
  state.counters["link_ratio"] = state.counters["swap_GBps"].value / state.counters["anchor_GBps"].value;
}

// The same loop on a CUDA device: real copies through the copy engines, the AdamW kernel on the SMs,
// and compute a host function holding the trainer's stream.
void cuda_runtime_overlap(benchmark::State& state)
{
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device: this benchmark needs a GPU (tools/gpu-check)");
    return;
  }
  const device dev = cuda_device(0);
  anchored_overlap(state, dev, dev);
}

// The emulated device under the h200 profile (Note [The h200 profile]): its link and its driver's
// virtual-memory costs, slowed by h200_time_scale. The emulator keeps up with the profile where
// this machine's memory copies keep up with the link (at 26 they do: 52 GB/s becomes 2 GB/s) and
// where its own work in a map (page tables: about 0.09 ms per MiB on a 2-core VM) fits in the time
// the model charges the map (a handle costs the H200 the same whatever its size). Slower than that,
// maps take the host's time, not the H200's, and the rows overstate what mapping costs: at 26 a
// 48 MiB map took 4.4 ms of the host against the model's 1.75 ms. At 104 both hold for the 4 Mi
// units and the streamed layers on a 2-core VM, not for the 12 Mi units' 144 MiB handles (whose
// transfer is three times as long); map_work_over_model says, row by row, whether they hold on the
// machine that runs the rows.
constexpr double h200_time_scale = 104.0;

device h200_device(std::size_t memory_bytes)
{
  emulated_options o;
  o.memory_bytes = memory_bytes;
  o.time_scale = h200_time_scale;
  return emulated_device(emulated_profile("h200", o));
}

// This host's own work in mapping one handle of `bytes` (the median of five maps, on a device that
// charges nothing) over the time the h200 model charges that map while copies run. Above 1, the
// emulated maps take the host's time, not the H200's.
double map_work_over_model(std::size_t bytes)
{
  emulated_options o = emulated_profile("h200", {});
  const vm_cost_model model = o.vm_costs;
  o.vm_costs = {};
  const std::size_t granules = (bytes + o.granularity - 1) / o.granularity;
  o.memory_bytes = granules * o.granularity;
  const device dev = emulated_device(o);
  detail::backend& b = dev.backend();
  void* handle = b.vm_create(granules);
  std::byte* at = b.vm_reserve(o.memory_bytes);
  std::vector<double> took;
  for (int i = 0; i < 6; ++i) {
    const auto start = clock_type::now();
    b.vm_map(at, handle, granules);
    if (i > 0) { took.push_back(std::chrono::duration<double>(clock_type::now() - start).count()); }
    b.vm_unmap(at, granules);
  }
  b.vm_release(handle, granules);
  b.vm_free(at, o.memory_bytes);
  std::sort(took.begin(), took.end());
  const double mib = static_cast<double>(o.memory_bytes) / double(1 << 20);
  const double modelled = (model.map.per_call_seconds + model.access.per_call_seconds +
                           mib * (model.map.per_mib_seconds + model.access.per_mib_seconds)) *
                          h200_time_scale * model.busy_factor;
  return took[took.size() / 2] / modelled;
}

void runtime_overlap_h200(benchmark::State& state)
{
  const std::size_t unit_bytes = 4 * static_cast<std::size_t>(state.range(0)) * sizeof(float);
  anchored_overlap(state, h200_device(3 * unit_bytes), h200_device(8 * unit_bytes));
  state.counters["map_work_over_model"] = map_work_over_model(unit_bytes / 4 * 3);  // moments and gradients
}

// One step over a streamed trunk: the task unit, then every layer forward (a frozen use: its
// parameters alone), then every layer backward (a trained use, stepped and released at once); each
// use "computes" on the stream for `forward` or `backward`.
step_plan streamed_step(std::size_t layers)
{
  step_plan p;
  p.acquire(unit_id{0});
  for (std::uint32_t l = 1; l <= layers; ++l) { p.acquire(unit_id{l}, unit_use::frozen).release(unit_id{l}); }
  for (auto l = static_cast<std::uint32_t>(layers); l >= 1; --l) { p.acquire(unit_id{l}).release(unit_id{l}); }
  return p;
}

loop_result stream_steps(runtime& rt, stream& s, std::size_t layers, std::size_t steps,
                         std::chrono::microseconds forward, std::chrono::microseconds backward, std::size_t& planned,
                         std::size_t& done)
{
  const runtime_stats before = rt.stats();
  rt.flush();
  s.synchronize();
  const auto compute = [&](std::chrono::microseconds t) {
    launch_host_func(s, [t] { std::this_thread::sleep_for(t); });
  };
  const auto begin = clock_type::now();
  for (std::size_t i = 0; i < steps; ++i, ++done) {
    for (; planned < done + 3; ++planned) { rt.plan(streamed_step(layers)); }
    (void)rt.acquire(unit_id{0}, s);
    for (std::uint32_t l = 1; l <= layers; ++l) {
      (void)rt.acquire(unit_id{l}, s, unit_use::frozen);
      compute(forward);
      rt.release(unit_id{l}, s);
    }
    for (auto l = static_cast<std::uint32_t>(layers); l >= 1; --l) {
      (void)rt.acquire(unit_id{l}, s);
      compute(backward);
      rt.step(unit_id{l}, s);
      rt.release(unit_id{l}, s);
    }
    rt.step(unit_id{0}, s);
    rt.release(unit_id{0}, s);
    (void)rt.end_step();
  }
  s.synchronize();
  return result_since(rt, before, std::chrono::duration<double>(clock_type::now() - begin).count());
}

// A trunk of `layers` trained layer units of `elements` f32 parameters each, streamed through a
// budget of the task unit and `room` layers (3: the two the backward holds and one prefetched),
// against the same loop with every unit resident, in the same run, on devices `make_device` makes
// (of the given memory) whose link moves `link` bytes per second each way. A layer's forward
// computes compute_factor × its parameters' transfer, its backward compute_factor × its whole
// travel (the optimizer state in, the update out), so compute ≥ transfer at a factor ≥ 1.
template <class MakeDevice>
void streaming(benchmark::State& state, std::size_t elements, double link, const MakeDevice& make_device,
               std::size_t first_arg = 0)
{
  const auto layers = static_cast<std::size_t>(state.range(first_arg));
  const double compute_factor = static_cast<double>(state.range(first_arg + 1)) / 100.0;
  const auto room = static_cast<std::size_t>(state.range(first_arg + 2));
  constexpr std::size_t steps = 6;
  std::vector<unit_spec> streamed_specs{task_unit(0, elements / 4, residency::prefetch, 1)};
  std::vector<unit_spec> resident_specs{task_unit(0, elements / 4, residency::pinned, 1)};
  for (std::size_t l = 1; l <= layers; ++l) {
    streamed_specs.push_back(task_unit(l, elements, residency::prefetch, 1));
    resident_specs.push_back(task_unit(l, elements, residency::pinned, 1));
  }
  const std::size_t layer_bytes = 4 * elements * sizeof(float);
  const std::size_t task_bytes = layer_bytes / 4;
  runtime_options streamed_options;
  streamed_options.device.budget = task_bytes + room * layer_bytes;
  const char* const trace = std::getenv("TASKSWAP_BENCH_TRACE");
  streamed_options.trace = trace != nullptr;
  runtime_options resident_options;
  resident_options.device.budget = task_bytes + layers * layer_bytes;
  const device streamed_dev = make_device(streamed_options.device.budget);
  const device resident_dev = make_device(resident_options.device.budget);
  runtime streamed(streamed_dev, streamed_options, streamed_specs);
  runtime resident(resident_dev, resident_options, resident_specs);
  stream streamed_stream(streamed_dev);
  stream resident_stream(resident_dev);
  const auto seconds = [&](std::size_t bytes) {
    return std::chrono::duration<double>(static_cast<double>(bytes) / link);
  };
  const auto forward =
    std::chrono::duration_cast<std::chrono::microseconds>(seconds(elements * sizeof(float)) * compute_factor);
  const auto backward =
    std::chrono::duration_cast<std::chrono::microseconds>(seconds(3 * elements * sizeof(float)) * compute_factor);
  std::size_t sp = 0, sd = 0, rp = 0, rd = 0;
  (void)stream_steps(streamed, streamed_stream, layers, 1, forward, backward, sp, sd);  // warm-up
  (void)stream_steps(resident, resident_stream, layers, 1, forward, backward, rp, rd);
  double streamed_seconds = 0, resident_seconds = 0, stall_ms = 0;
  std::size_t h2d = 0, misses = 0, peak = 0;
  for (auto _ : state) {
    const loop_result a = stream_steps(resident, resident_stream, layers, steps, forward, backward, rp, rd);
    const loop_result b = stream_steps(streamed, streamed_stream, layers, steps, forward, backward, sp, sd);
    resident_seconds += a.seconds;
    streamed_seconds += b.seconds;
    stall_ms += b.totals.stall_ms;
    h2d += b.totals.h2d_bytes;
    misses += b.totals.misses;
    peak = std::max(peak, b.totals.peak_device_bytes);
    state.SetIterationTime(b.seconds);
  }
  if (trace != nullptr) { streamed.write_trace(trace); }
  const double n = static_cast<double>(state.iterations()) * static_cast<double>(steps);
  state.counters["step_time_ratio"] = streamed_seconds / resident_seconds;
  state.counters["step_ms_streamed"] = streamed_seconds / n * 1e3;
  state.counters["step_ms_resident"] = resident_seconds / n * 1e3;
  state.counters["stall_ms_per_step"] = stall_ms / n;
  state.counters["h2d_MiB_per_step"] = static_cast<double>(h2d) / n / (1 << 20);
  state.counters["misses"] = static_cast<double>(misses);
  state.counters["trunk_over_budget"] =
    static_cast<double>(layers * layer_bytes) / static_cast<double>(streamed_options.device.budget);
  state.counters["peak_over_budget"] = static_cast<double>(peak) / static_cast<double>(streamed_options.device.budget);
}

// runtime_streaming: 1 MiB of f32 parameters a layer on the emulated device with a 5 GB/s link.
// Target: step_time_ratio ≤ 1.10.
void runtime_streaming(benchmark::State& state)
{
  constexpr double link = 5e9;
  streaming(state, 256 * 1024, link, [](std::size_t budget) {
    return emulated_device({.memory_bytes = budget, .link = {.bytes_per_second = link}});
  });
}

// The link's one-way rate without the runtime, in bytes per second: a plain host-to-device copy of
// `bytes` between a pinned_buffer and a device buffer.
double plain_h2d_rate(const device& dev, std::size_t bytes)
{
  pinned_buffer host(dev, bytes);
  device_buffer target(dev, bytes);
  stream up(dev);
  return static_cast<double>(bytes) / fastest_round(dev, up, [&] { copy_async(target.span(), host.span(), up); });
}

// cuda_runtime_streaming: runtime_streaming's loop on a CUDA device, 16 MiB of f32 parameters a
// layer (64 MiB with their state and gradients), the compute a host function holding the trainer's
// stream for compute_factor × the layer's transfer at the link's measured one-way rate (the anchor,
// a plain pinned copy in the same run). Target: step_time_ratio ≤ 1.05.
void cuda_runtime_streaming(benchmark::State& state)
{
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device: this benchmark needs a GPU (tools/gpu-check)");
    return;
  }
  const device dev = cuda_device(0);
  constexpr std::size_t elements = std::size_t{4} << 20;
  const double link = plain_h2d_rate(dev, elements * sizeof(float));
  streaming(state, elements, link, [&](std::size_t) { return dev; });
  state.counters["link_GBps"] = link / 1e9;
}

// The same on the emulated h200 (its 2 MiB granules, link and mapping costs, slowed h200_time_scale
// times), with layers of the first argument's f32 parameters; the others are streaming()'s.
void runtime_streaming_h200(benchmark::State& state)
{
  const auto elements = static_cast<std::size_t>(state.range(0));
  streaming(state, elements, 52e9 / h200_time_scale, h200_device, 1);
  state.counters["map_work_over_model"] = map_work_over_model(3 * elements * sizeof(float));
}

}  // namespace

// {registered units, units the budget holds}: all resident (every acquire a hit, no copies), and
// 64 resident (every step evicts one unit and prefetches another).
BENCHMARK(runtime_acquire_release)
  ->Args({1000, 1000})
  ->Args({10000, 10000})
  ->Args({1000, 64})
  ->Args({10000, 64})
  ->UseManualTime()
  ->Unit(benchmark::kMicrosecond)
  ->MinTime(1.0);
// 1 Mi f32 elements: 12 MiB travel each way per step, 2.5 ms at 5 GB/s; compute 1.25× and 2×.
BENCHMARK(runtime_overlap)
  ->Args({1 << 20, 125})
  ->Args({1 << 20, 200})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(4);
// 28 and 56 layers of 4 MiB, compute 1.25x and 2x the transfer, room for 3 layers (8.6x and 17x
// the budget) and for 4.
BENCHMARK(runtime_streaming)
  ->ArgsProduct({{28, 56}, {125, 200}, {3, 4}})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(2);
// As cuda_runtime_overlap, at its sizes 4 Mi and 12 Mi f32 elements, on the emulated h200.
BENCHMARK(runtime_overlap_h200)
  ->Name("runtime_overlap/h200")
  ->ArgsProduct({{4 << 20, 12 << 20}, {0, 125, 200}})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(2);
// 28 layers of 1 Mi and 4 Mi f32 parameters (16 and 64 MiB with their state and gradients; the
// second is cuda_runtime_streaming's), compute 1.25x and 2x, room for 3, on the emulated h200.
BENCHMARK(runtime_streaming_h200)
  ->Name("runtime_streaming/h200")
  ->ArgsProduct({{1 << 20, 4 << 20}, {28}, {125, 200}, {3}})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(2);
// 28 layers of 64 MiB, compute 1.25x and 2x, room for 3 and 4, on a CUDA device.
BENCHMARK(cuda_runtime_streaming)
  ->ArgsProduct({{28}, {125, 200}, {3, 4}})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(2);
// 4 Mi, 12 Mi and 24 Mi f32 elements (48, 144, 288 MiB each way per step); compute 0 (the swap
// rate against the plain copy), 1.25× and 2× the measured transfer.
BENCHMARK(cuda_runtime_overlap)
  ->ArgsProduct({{4 << 20, 12 << 20, 24 << 20}, {0, 125, 200}})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(3);
