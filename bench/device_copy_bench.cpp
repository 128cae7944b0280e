// SPDX-License-Identifier: Apache-2.0
// Copy benchmarks of the device layer.
//
// device_link_model: host->device copies on the emulated backend with a 5 GB/s link model;
//   bandwidth_ratio = achieved / modelled bandwidth (expect ~1: the model, not the machine, sets
//   the time).
// device_link_model_duplex, cuda_copy_duplex: a host->device and a device->host copy of the same
//   size on two streams at once. The anchors, each direction alone, run in the same benchmark;
//   overlap = (time alone H2D + time alone D2H) / time together: 2 when the directions overlap
//   fully, 1 when they serialise.
// Times are event timings on the copy stream(s), warm-up excluded.

#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>

#include <cstring>
#include <string>

namespace {

using namespace taskswap;
constexpr std::int64_t MiB = std::int64_t{1} << 20;
constexpr std::int64_t GiB = std::int64_t{1} << 30;
constexpr double modelled_rate = 5e9;  // bytes per second, below this machine's memcpy rate

device link_modelled_device(std::size_t memory)
{
  return emulated_device({.memory_bytes = memory, .link = {.bytes_per_second = modelled_rate}});
}

// Host and device buffers for one size, touched once so page faults stay out of the timings.
struct copy_buffers {
  copy_buffers(const device& dev, std::size_t bytes)
      : host_in(dev, bytes), host_out(dev, bytes), device_in(dev, bytes), device_out(dev, bytes)
  {
    std::memset(host_in.data(), 0x3C, bytes);
    std::memset(host_out.data(), 0, bytes);
    stream s(dev);
    fill_async(device_in.span(), std::byte{0}, s);
    fill_async(device_out.span(), std::byte{0x5A}, s);
    s.synchronize();
  }
  pinned_buffer host_in;
  pinned_buffer host_out;
  device_buffer device_in;
  device_buffer device_out;
};

// Seconds from `start` to `end`, recorded on the given streams around `enqueue`.
template <typename Enqueue>
double timed(const device& dev, stream_view first, stream_view second, Enqueue&& enqueue)
{
  event start(dev, {.timing = true});
  event second_done(dev);
  event end(dev, {.timing = true});
  start.record(first);
  start.wait(second);
  enqueue();
  second_done.record(second);
  second_done.wait(first);
  end.record(first);
  end.synchronize();
  return elapsed_ms(start, end) / 1e3;
}

void device_link_model(benchmark::State& state)
{
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const device dev = link_modelled_device(2 * bytes);
  copy_buffers buffers(dev, bytes);
  stream s(dev);
  copy_async(buffers.device_in.span(), buffers.host_in.span(), s);  // warm-up
  s.synchronize();
  double total = 0.0;
  for (auto _ : state) {
    const double seconds = timed(dev, s, s, [&] { copy_async(buffers.device_in.span(), buffers.host_in.span(), s); });
    state.SetIterationTime(seconds);
    total += seconds;
  }
  const double achieved = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / total;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["bandwidth_ratio"] = achieved / modelled_rate;
}

// Runs H2D alone, D2H alone, then both at once; reports the together time and the overlap.
void duplex(benchmark::State& state, const device& dev, std::size_t bytes)
{
  copy_buffers buffers(dev, bytes);
  stream up(dev);
  stream down(dev);
  auto h2d = [&] { copy_async(buffers.device_in.span(), buffers.host_in.span(), up); };
  auto d2h = [&] { copy_async(buffers.host_out.span(), buffers.device_out.span(), down); };
  timed(dev, up, down, [&] {
    h2d();
    d2h();
  });  // warm-up
  double alone = 0.0;
  double together = 0.0;
  for (auto _ : state) {
    const double t_up = timed(dev, up, up, h2d);
    const double t_down = timed(dev, down, down, d2h);
    const double t_both = timed(dev, up, down, [&] {
      h2d();
      d2h();
    });
    state.SetIterationTime(t_both);
    alone += t_up + t_down;
    together += t_both;
  }
  state.SetBytesProcessed(2 * static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["overlap"] = alone / together;
  state.counters["bidirectional_GBps"] =
    2.0 * static_cast<double>(bytes) * static_cast<double>(state.iterations()) / together / 1e9;
}

void device_link_model_duplex(benchmark::State& state)
{
  const auto bytes = static_cast<std::size_t>(state.range(0));
  duplex(state, link_modelled_device(2 * bytes), bytes);
  state.counters["bandwidth_ratio"] = state.counters["bidirectional_GBps"].value * 1e9 / (2 * modelled_rate);
}

void cuda_copy_duplex(benchmark::State& state)
{
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device: this benchmark needs a GPU (tools/gpu-check)");
    return;
  }
  duplex(state, cuda_device(0), static_cast<std::size_t>(state.range(0)));
}

}  // namespace

BENCHMARK(device_link_model)->RangeMultiplier(4)->Range(MiB, GiB)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(device_link_model_duplex)
  ->RangeMultiplier(4)
  ->Range(MiB, GiB)
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond);
BENCHMARK(cuda_copy_duplex)->RangeMultiplier(4)->Range(MiB, GiB)->UseManualTime()->Unit(benchmark::kMillisecond);
