// SPDX-License-Identifier: Apache-2.0
// Behaviour only the emulated backend has: separate devices, the option checks, the link model.
// Timing checks here are lower bounds (a modelled copy never finishes early); how close to the
// model copies come is measured by the device_link_model benchmark, not here.

#include <taskswap/taskswap.hpp>

#include "device/backend.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t MiB = std::size_t{1} << 20;

double seconds_since(clock_type::time_point start)
{
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

TEST(emulated_backend, EachDeviceIsDistinctWithItsOwnMemory)
{
  const device a = emulated_device({.memory_bytes = 8 * MiB});
  const device b = emulated_device({.memory_bytes = 4 * MiB});
  EXPECT_FALSE(a == b);
  EXPECT_NE(a.index(), b.index());
  EXPECT_EQ(a.kind(), backend_kind::emulated);
  EXPECT_EQ(a.name(), "emulated:" + std::to_string(a.index()));
  device_buffer held(a, 6 * MiB);
  EXPECT_EQ(a.memory().free, 2 * MiB);
  EXPECT_EQ(b.memory().free, 4 * MiB);
  // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): a copy refers to the same device
  const device copy = a;
  EXPECT_TRUE(copy == a);
  EXPECT_EQ(copy.memory().free, 2 * MiB);
}

TEST(emulated_backend, OutOfMemoryNamesRequestedFreeAndTotal)
{
  const device dev = emulated_device({.memory_bytes = 10 * MiB});
  device_buffer held(dev, 7 * MiB);
  try {
    device_buffer more(dev, 4 * MiB);
    FAIL() << "4 MiB fit beside 7 MiB in a 10 MiB device";
  } catch (const out_of_memory& e) {
    EXPECT_EQ(e.requested(), 4 * MiB);
    EXPECT_EQ(e.available(), 3 * MiB);
    EXPECT_EQ(e.budget(), 10 * MiB);
    const std::string text = e.what();
    EXPECT_NE(text.find("cannot allocate 4.0 MiB (4194304 bytes)"), std::string::npos) << text;
    EXPECT_NE(text.find("3.0 MiB (3145728 bytes) free of 10.0 MiB (10485760 bytes)"), std::string::npos) << text;
  }
  device_buffer fits(dev, 3 * MiB);  // the refused request took nothing
  EXPECT_EQ(dev.memory().free, 0U);
}

TEST(emulated_backend, RefusesNonsenseOptions)
{
  EXPECT_THROW(static_cast<void>(emulated_device({.memory_bytes = 0})), invalid_argument);
  EXPECT_THROW(static_cast<void>(emulated_device({.link = {.bytes_per_second = -1.0}})), invalid_argument);
  EXPECT_THROW(static_cast<void>(emulated_device({.link = {.bytes_per_second = 1e9, .latency_seconds = -1e-6}})),
               invalid_argument);
}

TEST(emulated_backend, ModelledCopiesNeverFinishEarly)
{
  constexpr double rate = 1e9;  // 1 GB/s: 32 MiB take 33.5 ms
  const device dev = emulated_device({.memory_bytes = 64 * MiB, .link = {.bytes_per_second = rate}});
  stream s(dev);
  device_buffer d(dev, 32 * MiB);
  pinned_buffer h(dev, 32 * MiB);
  std::memset(h.data(), 1, h.size());
  const auto start = clock_type::now();
  copy_async(d.span(), h.span(), s);
  copy_async(h.span(), d.span(), s);
  s.synchronize();
  EXPECT_GE(seconds_since(start), 2.0 * 32.0 * MiB / rate);
}

TEST(emulated_backend, LatencyIsChargedPerCopy)
{
  const device dev =
    emulated_device({.memory_bytes = MiB, .link = {.bytes_per_second = 1e12, .latency_seconds = 1e-3}});
  stream s(dev);
  device_buffer d(dev, 64);
  pinned_buffer h(dev, 64);
  const auto start = clock_type::now();
  for (int i = 0; i < 20; ++i) { copy_async(d.span(0, 1), h.span().subspan(0, 1), s); }
  s.synchronize();
  EXPECT_GE(seconds_since(start), 20e-3);
}

TEST(emulated_backend, CopiesInOneDirectionShareTheLink)
{
  constexpr double rate = 1e9;
  const device dev = emulated_device({.memory_bytes = 64 * MiB, .link = {.bytes_per_second = rate}});
  stream first(dev);
  stream second(dev);
  device_buffer d(dev, 32 * MiB);
  pinned_buffer h(dev, 32 * MiB);
  std::memset(h.data(), 2, h.size());
  const auto start = clock_type::now();
  copy_async(d.span(0, 16 * MiB), h.span().subspan(0, 16 * MiB), first);
  copy_async(d.span(16 * MiB, 16 * MiB), h.span().subspan(16 * MiB, 16 * MiB), second);
  first.synchronize();
  second.synchronize();
  // Two streams, one host-to-device link: the copies take their sum, not their maximum.
  EXPECT_GE(seconds_since(start), 32.0 * MiB / rate);
}

// A virtual-memory call takes its caller the model's time in all: the emulator's own work in the
// call (here the page tables of a 512 MiB mapping) is part of that time, as the driver's own work
// is part of the time measured on a GPU, not added to it.
TEST(emulated_backend, AVirtualMemoryCallsOwnWorkIsPartOfItsModelledTime)
{
  constexpr std::size_t granule = 2 * MiB;
  constexpr std::size_t granules = 256;
  // The mean of five maps of one handle: what one sleep overshoots, the next pays back.
  const auto map_seconds = [&](const vm_cost_model& costs) {
    const device dev = emulated_device({.memory_bytes = granules * granule, .granularity = granule, .vm_costs = costs});
    detail::backend& b = dev.backend();
    void* handle = b.vm_create(granules);
    std::byte* at = b.vm_reserve(granules * granule);
    std::vector<double> took;
    for (int i = 0; i < 6; ++i) {
      const auto start = clock_type::now();
      b.vm_map(at, handle, granules);
      if (i > 0) { took.push_back(seconds_since(start)); }  // the first touches the memory's pages
      b.vm_unmap(at, granules);
    }
    b.vm_release(handle, granules);
    b.vm_free(at, granules * granule);
    return std::accumulate(took.begin(), took.end(), 0.0) / static_cast<double>(took.size());
  };
  const double work = map_seconds({});
  if (work < 10e-3) { GTEST_SKIP() << "a map takes this host " << work * 1e3 << " ms: too little to tell"; }
  vm_cost_model costs;
  costs.map.per_call_seconds = std::max(0.05, 4 * work);
  const double charged = map_seconds(costs);
  EXPECT_GE(charged, costs.map.per_call_seconds - 1e-3);
  EXPECT_LT(charged, costs.map.per_call_seconds + work / 2)
    << "a map's own work (" << work * 1e3 << " ms) was added to the model's time";
}

TEST(emulated_backend, AHostSynchronousStreamRunsEachOperationBeforeTheCallReturns)
{
  constexpr double rate = 1e9;
  const device dev = emulated_device({.memory_bytes = 64 * MiB, .link = {.bytes_per_second = rate}});
  stream inline_stream(dev, {.priority = 0, .host_synchronous = true});
  stream worker(dev);
  device_buffer d(dev, 8 * MiB);
  pinned_buffer h(dev, 8 * MiB);
  std::memset(h.data(), 3, h.size());
  // A copy is done, at the link's rate, when copy_async returns; an event recorded after it too.
  auto start = clock_type::now();
  copy_async(d.span(), h.span(), inline_stream);
  EXPECT_GE(seconds_since(start), 8.0 * MiB / rate);
  event e(dev);
  e.record(inline_stream);
  EXPECT_TRUE(e.query());
  EXPECT_TRUE(inline_stream.query());
  int ran = 0;
  launch_host_func(inline_stream, [&] { ++ran; });
  EXPECT_EQ(ran, 1);
  // A wait on another stream's work blocks the enqueuing thread until that work is done.
  event other(dev);
  start = clock_type::now();
  copy_async(h.span(), d.span(), worker);
  other.record(worker);
  other.wait(inline_stream);
  EXPECT_TRUE(other.query());
  EXPECT_GE(seconds_since(start), 8.0 * MiB / rate);
  EXPECT_EQ(static_cast<int>(h.data()[8 * MiB - 1]), 3);
}

TEST(build_info, DescribesThisBuild)
{
  const build_info info = get_build_info();
  EXPECT_FALSE(info.version.empty());
  EXPECT_EQ(info.cuda, !info.cuda_runtime_version.empty());
  EXPECT_EQ(info.nccl, !info.nccl_version.empty());
  EXPECT_EQ(info.mpi, !info.mpi_library_version.empty());
  EXPECT_EQ(info.nccl, !info.nccl_library.empty());  // the file loaded, or why none could be
  if (info.nccl) {
    EXPECT_EQ(std::count(info.nccl_version.begin(), info.nccl_version.end(), '.'), 2) << info.nccl_version;
  }
  const build_info features = build_features();
  EXPECT_EQ(features.version, info.version);
  EXPECT_EQ(features.nccl, info.nccl);
  EXPECT_TRUE(features.nccl_version.empty());
  if (!info.cuda) { EXPECT_EQ(cuda_device_count(), 0); }
}

TEST(build_info, CudaDeviceOutOfRangeSaysHowManyThereAre)
{
  try {
    static_cast<void>(cuda_device(cuda_device_count()));
    FAIL() << "a CUDA ordinal past the last device was accepted";
  } catch (const cuda_error& e) {
    const std::string text = e.what();
    EXPECT_TRUE(text.find("does not exist") != std::string::npos ||
                text.find("built without CUDA") != std::string::npos)
      << text;
  }
}

}  // namespace
}  // namespace taskswap::test
