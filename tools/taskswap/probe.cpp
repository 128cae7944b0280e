// SPDX-License-Identifier: Apache-2.0
// `taskswap probe`: the devices, the NUMA node of each, host↔device copy rates from the local
// node and from a remote one, and the copy engines; the emulated device where there is no GPU.
// With --storage, the disk tier's unit-file read and write rates on that directory's drive.

#include "commands.hpp"

#include "storage/unit_files.hpp"

#include <unistd.h>

#if TASKSWAP_TOOLS_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

namespace taskswap::tools {

copy_rates measure_copies(const device& dev, int numa_node, std::size_t bytes, int repeats)
{
  pinned_arena arena(dev, {.bytes = bytes, .numa_node = numa_node});
  const std::span<std::byte> host = arena.allocate(bytes);
  device_buffer buffer(dev, bytes);
  const stream s(dev);
  event start(dev, {.timing = true});
  event end(dev, {.timing = true});
  copy_async(buffer.span(), host, s);  // warm-up: first-touch and mappings
  copy_async(host, buffer.span(), s);
  s.synchronize();
  const auto rate = [&](bool to_device) {
    start.record(s);
    for (int i = 0; i < repeats; ++i) {
      if (to_device) {
        copy_async(buffer.span(), host, s);
      } else {
        copy_async(host, buffer.span(), s);
      }
    }
    end.record(s);
    end.synchronize();
    return static_cast<double>(bytes) * repeats / (elapsed_ms(start, end) / 1e3);
  };
  copy_rates r;
  r.h2d = rate(true);
  r.d2h = rate(false);
  return r;
}

namespace {

int copy_engines(const device& dev)
{
#if TASKSWAP_TOOLS_CUDA
  if (dev.kind() == backend_kind::cuda) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, dev.index()) == cudaSuccess) { return prop.asyncEngineCount; }
    return -1;
  }
#endif
  return dev.kind() == backend_kind::emulated ? 2 : -1;  // emulated: one link per direction
}

nlohmann::json measure_storage(const std::string& dir, std::size_t bytes, int repeats)
{
  const storage_rates r = measure_storage_rates(dir, bytes, repeats);
  const detail::unit_file_options options{.directory = dir};
  std::printf("\nstorage %s (%s): read %.2f GB/s, write %.2f GB/s (a %s unit file, queue depth %u, %s blocks)\n",
              dir.c_str(), r.direct ? "O_DIRECT" : "buffered: no O_DIRECT there", r.read / 1e9, r.write / 1e9,
              bytes_text(static_cast<double>(r.bytes)).c_str(), options.queue_depth,
              bytes_text(static_cast<double>(options.block_bytes)).c_str());
  return {{"path", dir},
          {"direct", r.direct},
          {"read_bytes_per_second", r.read},
          {"write_bytes_per_second", r.write},
          {"bytes", r.bytes},
          {"queue_depth", options.queue_depth},
          {"block_bytes", options.block_bytes},
          {"repeats", repeats}};
}

}  // namespace

storage_rates measure_storage_rates(const std::filesystem::path& dir, std::size_t bytes, int repeats)
{
  const std::filesystem::path where = dir / ("taskswap-probe-" + std::to_string(::getpid()));
  const detail::unit_file_options options{.directory = where};
  const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
  const std::unique_ptr<std::byte, decltype(&std::free)> memory(
    static_cast<std::byte*>(std::aligned_alloc(4096, rounded)), &std::free);
  const std::span<std::byte> buffer(memory.get(), rounded);
  std::memset(buffer.data(), 0x5a, buffer.size());
  double write = 0;
  double read = 0;
  bool direct = false;
  try {
    detail::unit_files files(options);
    files.register_buffers(buffer);
    direct = files.direct();
    const auto f = files.open("probe", 0, rounded);
    const auto pass = [&](bool writing) {
      const auto start = std::chrono::steady_clock::now();
      files.wait(writing ? files.write(f, 0, buffer) : files.read(f, 0, buffer));
      if (writing) { files.sync(f); }
      return static_cast<double>(rounded) /
             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    for (int k = 0; k < repeats; ++k) {
      write = std::max(write, pass(true));
      read = std::max(read, pass(false));
    }
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove_all(where, ignored);
    throw;
  }
  std::filesystem::remove_all(where);
  return {.read = read, .write = write, .direct = direct, .bytes = rounded};
}

int run_probe(const probe_args& args)
{
  const build_info info = get_build_info();
  const std::size_t bytes = parse_size(args.size);
  std::printf(
    "taskswap %s: cuda %s, nccl %s, mpi %s\n", info.version.c_str(),
    info.cuda ? ("runtime " + info.cuda_runtime_version + ", driver " + info.cuda_driver_version).c_str() : "no",
    info.nccl ? info.nccl_version.c_str() : "no", info.mpi ? info.mpi_library_version.c_str() : "no");
  std::vector<device> devices;
  const int gpus = args.emulated ? 0 : cuda_device_count();
  devices.reserve(static_cast<std::size_t>(gpus) + 1);
  for (int i = 0; i < gpus; ++i) { devices.push_back(cuda_device(i)); }
  if (devices.empty()) {
    devices.push_back(emulated_device({.memory_bytes = bytes + (std::size_t{1} << 20U), .link = {}}));
    std::printf("no CUDA device%s: probing the emulated device (host memory; copies are memcpy on a worker thread)\n",
                args.emulated ? " asked for" : "");
  }
  const topology_report topo = describe_topology(devices);
  std::printf("%s", topo.text().c_str());

  nlohmann::json j{{"version", info.version}, {"cuda", info.cuda}, {"devices", nlohmann::json::array()}};
  j["numa_nodes"] = nlohmann::json::array();
  for (const numa_node_info& n : topo.nodes) {
    j["numa_nodes"].push_back({{"os_index", n.os_index}, {"memory_bytes", n.memory_bytes}, {"cpus", n.cpus.size()}});
  }
  std::printf("\n%-28s %-6s %-10s %-8s %12s %12s\n", "device", "engines", "host node", "", "h2d GB/s", "d2h GB/s");
  for (const device& dev : devices) {
    const device_locality loc = locality_of(dev);
    const memory_info mem = dev.memory();
    nlohmann::json d{{"name", dev.name()},
                     {"backend", std::string(to_string(dev.kind()))},
                     {"index", dev.index()},
                     {"memory_total", mem.total},
                     {"memory_free", mem.free},
                     {"pci_bus_id", dev.pci_bus_id()},
                     {"numa_nodes", loc.numa_nodes},
                     {"locality_source", loc.source},
                     {"copy_engines", copy_engines(dev)},
                     {"bandwidth", nlohmann::json::array()}};
    // The local node, then one remote node when the machine has one.
    std::vector<std::pair<int, std::string>> nodes;
    const int local = loc.numa_nodes.empty() ? -1 : static_cast<int>(loc.numa_nodes.front());
    nodes.emplace_back(local, "local");
    for (const numa_node_info& n : topo.nodes) {
      if (static_cast<int>(n.os_index) != local) {
        nodes.emplace_back(static_cast<int>(n.os_index), "remote");
        break;
      }
    }
    for (const auto& [node, kind] : nodes) {
      const copy_rates r = measure_copies(dev, node, bytes, args.repeats);
      std::printf("%-28s %-6d node %-5d %-8s %12.2f %12.2f\n", dev.name().substr(0, 28).c_str(), copy_engines(dev),
                  node, kind.c_str(), r.h2d / 1e9, r.d2h / 1e9);
      d["bandwidth"].push_back({{"numa_node", node},
                                {"kind", kind},
                                {"h2d_bytes_per_second", r.h2d},
                                {"d2h_bytes_per_second", r.d2h},
                                {"bytes", bytes},
                                {"repeats", args.repeats}});
    }
    if (nodes.size() == 1) { std::printf("  (one NUMA node: no remote node to measure from)\n"); }
    j["devices"].push_back(std::move(d));
  }
  if (!args.storage.empty()) {
    j["storage"] = measure_storage(args.storage, parse_size(args.storage_size), args.repeats);
  }
  if (!args.json.empty()) { write_json(j, args.json); }
  return 0;
}

}  // namespace taskswap::tools
