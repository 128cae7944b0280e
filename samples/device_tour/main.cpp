// SPDX-License-Identifier: Apache-2.0
// A tour of the device and host layers, and `make demo` until the multi-task trainer exists: it
// picks the GPU when there is one and otherwise an emulated device with a PCIe-like link model,
// prints where the device sits in the NUMA topology, builds a pinned NUMA-local arena, moves random
// data from an arena slab -> device -> device -> host on two streams ordered by an event, checks it
// bit for bit, shows that opposite-direction copies overlap, and shows the error a too-large
// allocation gives.

#include <taskswap/taskswap.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace taskswap;
constexpr std::size_t MiB = std::size_t{1} << 20;

double seconds_between(const event& start, const event& end) { return elapsed_ms(start, end) / 1e3; }

double gbps(std::size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

}  // namespace

int main(int argc, char** argv)
{
  const bool force_emulated = argc > 1 && std::string(argv[1]) == "--emulated";
  const build_info info = get_build_info();
  std::printf("taskswap %s  cuda=%s (runtime %s, driver %s)  nccl=%s  mpi=%s\n", info.version.c_str(),
              info.cuda ? "yes" : "no", info.cuda ? info.cuda_runtime_version.c_str() : "-",
              info.cuda ? info.cuda_driver_version.c_str() : "-", info.nccl ? info.nccl_version.c_str() : "no",
              info.mpi ? info.mpi_library_version.c_str() : "no");

  // 5 GB/s and 10 us per copy: a modest PCIe link, slower than a host memcpy on a small machine,
  // so that the model and not the machine sets the copy times.
  const link_model pcie{.bytes_per_second = 5e9, .latency_seconds = 10e-6};
  const bool on_gpu = !force_emulated && cuda_device_count() > 0;
  const device dev = on_gpu ? cuda_device(0) : emulated_device({.memory_bytes = 512 * MiB, .link = pcie});
  const memory_info memory = dev.memory();
  std::printf("device   %s (%s backend), %.0f MiB free of %.0f MiB%s\n", dev.name().c_str(),
              std::string(to_string(dev.kind())).c_str(), static_cast<double>(memory.free) / MiB,
              static_cast<double>(memory.total) / MiB, on_gpu ? "" : ", link model 5 GB/s + 10 us per copy");

  // Where the device sits, and a pinned arena on its NUMA node to hold unit homes.
  const std::vector<device> devices{dev};
  std::printf("%s", describe_topology(devices).text().c_str());
  double pin_rate = 0.0;
  pinned_arena arena(dev, {.bytes = 256 * MiB, .chunk_bytes = 64 * MiB, .on_progress = [&](const pin_progress& p) {
                             if (p.done_bytes == p.total_bytes) { pin_rate = p.bytes_per_second; }
                           }});
  std::printf("arena    %.0f MiB on NUMA node %u (%s), %s, built at %.1f GiB/s\n",
              static_cast<double>(arena.stats().reserved) / MiB, arena.numa_node(),
              arena.bound() ? "bound" : "binding refused by the OS", arena.locked() ? "page-locked" : "pageable",
              pin_rate / static_cast<double>(1U << 30));

  constexpr std::size_t bytes = 128 * MiB;
  const std::span<std::byte> home = arena.allocate(bytes);  // a unit's home: a slab of the arena
  pinned_buffer source(dev, bytes);
  pinned_buffer result(dev, bytes);
  std::mt19937_64 gen{std::random_device{}()};
  for (std::size_t i = 0; i < bytes; i += 8) {
    const std::uint64_t word = gen();
    std::memcpy(home.data() + i, &word, 8);
  }
  std::memcpy(source.data(), home.data(), bytes);
  std::memset(result.data(), 0, bytes);
  device_buffer staging(dev, bytes);
  device_buffer resident(dev, bytes);

  stream copy_in(dev);
  stream compute(dev);
  event t0(dev, {.timing = true});
  event arrived(dev, {.timing = true});
  event t2(dev, {.timing = true});
  t0.record(copy_in);
  copy_async(staging.span(), home, copy_in);  // from the arena slab
  arrived.record(copy_in);
  arrived.wait(compute);  // the compute stream waits on the copy without blocking the host
  copy_async(resident.span(), staging.span(), compute);
  copy_async(result.span(), resident.span(), compute);
  t2.record(compute);
  t2.synchronize();
  const bool exact = std::memcmp(source.data(), result.data(), bytes) == 0;
  std::printf("copies   128 MiB arena slab -> device on copy stream: %.2f ms (%.1f GB/s)\n",
              1e3 * seconds_between(t0, arrived), gbps(bytes, seconds_between(t0, arrived)));
  std::printf("         then device->device->host on compute stream after an event: %.2f ms\n",
              1e3 * seconds_between(arrived, t2));
  std::printf("         round trip bit-exact: %s\n", exact ? "yes" : "NO");

  // Opposite directions on two streams: each alone, then both at once.
  stream copy_out(dev);
  event a(dev, {.timing = true});
  event b(dev, {.timing = true});
  a.record(copy_in);
  copy_async(staging.span(), source.span(), copy_in);
  b.record(copy_in);
  b.synchronize();
  const double up = seconds_between(a, b);
  a.record(copy_out);
  copy_async(result.span(), resident.span(), copy_out);
  b.record(copy_out);
  b.synchronize();
  const double down = seconds_between(a, b);
  event out_done(dev);
  a.record(copy_in);
  a.wait(copy_out);
  copy_async(staging.span(), source.span(), copy_in);
  copy_async(result.span(), resident.span(), copy_out);
  out_done.record(copy_out);
  out_done.wait(copy_in);
  b.record(copy_in);
  b.synchronize();
  const double both = seconds_between(a, b);
  std::printf("duplex   H2D alone %.2f ms, D2H alone %.2f ms, both on two streams %.2f ms (overlap %.2fx)\n", 1e3 * up,
              1e3 * down, 1e3 * both, (up + down) / both);

  try {
    device_buffer too_big(dev, dev.memory().total + MiB);
  } catch (const out_of_memory& e) {
    std::printf("budget   an allocation beyond the device is refused:\n         %s\n", e.what());
  }
  return exact ? 0 : 1;
}
