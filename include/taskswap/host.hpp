// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The host side: where a device sits in the machine's NUMA topology, and the pinned,
/// NUMA-local arena that holds every unit's home copy.

#include <taskswap/device.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace taskswap {

/// @brief One NUMA node of the machine.
struct numa_node_info {
  unsigned os_index = 0;  ///< the node number the OS uses (numactl, /sys)
  std::size_t memory_bytes = 0;  ///< local memory
  std::vector<unsigned> cpus;  ///< OS indexes of its processing units
};

/// @brief The NUMA node(s) and CPUs closest to a device, and how that was found.
struct device_locality {
  std::vector<unsigned> numa_nodes;  ///< OS indexes, nearest first (usually one)
  std::vector<unsigned> cpus;  ///< OS indexes of the CPUs local to the device
  bool from_device = false;  ///< true when found through the device's PCI location
  std::string source;  ///< "PCI 0000:65:00.0", or why the fallback was taken
};

/// @brief Finds the NUMA node(s) and CPUs local to `dev` through hwloc's PCI locality. Without
/// a PCI location (emulated device, or hwloc without I/O discovery) it falls back to the node of
/// the calling thread and says so in `source`.
[[nodiscard]] device_locality locality_of(const device& dev);

/// @brief The machine's NUMA nodes and the locality of the given devices.
struct topology_report {
  std::vector<numa_node_info> nodes;
  std::vector<std::pair<std::string, device_locality>> devices;  ///< device name, locality

  /// @brief A table a person reads (what `taskswap probe` prints).
  [[nodiscard]] std::string text() const;
};

/// @brief Describes the NUMA topology and where each device in `devices` sits.
[[nodiscard]] topology_report describe_topology(std::span<const device> devices = {});

/// @brief Progress of building an arena, reported from the constructing thread.
struct pin_progress {
  std::string_view phase;  ///< "prefault" or "lock"
  std::size_t done_bytes = 0;
  std::size_t total_bytes = 0;
  double bytes_per_second = 0;  ///< rate of this phase so far
};

/// @brief Settings of a pinned arena.
struct pinned_arena_options {
  std::size_t bytes = 0;  ///< the slab bytes to hold; rounded up only to the page size
  int numa_node = -1;  ///< OS index of the node to bind to; -1: the device's node
  bool huge_pages = false;  ///< 2 MiB pages: hugetlbfs where reserved, else transparent
  bool lock_pages = false;  ///< emulated backend: mlock (the cuda backend always locks)
  std::size_t chunk_bytes = std::size_t{256} << 20;  ///< unit of pre-faulting and its progress (whole pages)
  unsigned threads = 0;  ///< pre-fault threads; 0: the node's CPUs
  /// Called after each chunk faulted in, and as locking begins and ends.
  std::function<void(const pin_progress&)> on_progress{};
};

/// @brief Byte accounting of an arena.
struct pinned_arena_stats {
  std::size_t reserved = 0;  ///< mapped bytes (the request rounded up to the page size)
  std::size_t used = 0;  ///< bytes in live slabs, alignment padding included
  std::size_t pinned = 0;  ///< bytes page-locked for the device
  std::size_t largest_free = 0;  ///< the largest free block (a slab that size fits if aligned at its start)
  std::size_t slabs = 0;  ///< live slabs
  /// @brief 1 - largest_free / free: 0 when the free space is one block.
  [[nodiscard]] double fragmentation() const noexcept
  {
    const std::size_t free = reserved - used;
    return free == 0 ? 0.0 : 1.0 - static_cast<double>(largest_free) / static_cast<double>(free);
  }
};

/// @brief Pinned host memory bound to one NUMA node, from which aligned slabs are carved.
/// Allocates exactly the bytes asked (page rounding only), binds them to the node (strict where
/// the OS allows, a warning where it cannot), pre-faults them in parallel on that node's CPUs and
/// page-locks them for the device as one range. Slabs are best-fit with coalescing. Move-only.
class pinned_arena {
 public:
  /// @brief Builds the arena; returns when every byte is faulted in and locked.
  /// @throws invalid_argument for 0 bytes, a node that does not exist, a chunk of 0 bytes
  /// @throws out_of_memory when the host cannot map or lock that much, with the numbers
  pinned_arena(const device& dev, pinned_arena_options options);
  ~pinned_arena();
  pinned_arena(pinned_arena&&) noexcept;
  pinned_arena& operator=(pinned_arena&&) noexcept;
  pinned_arena(const pinned_arena&) = delete;
  pinned_arena& operator=(const pinned_arena&) = delete;

  /// @brief A slab of `bytes` aligned to `alignment` (a power of two, at least 256).
  /// @throws out_of_memory when no free block fits, naming the free and largest-free bytes
  /// @throws invalid_argument for 0 bytes or a bad alignment
  [[nodiscard]] std::span<std::byte> allocate(std::size_t bytes, std::size_t alignment = 256);
  /// @brief Returns a slab obtained from allocate().
  /// @throws invalid_argument if `slab` is not a live slab of this arena
  void deallocate(std::span<std::byte> slab);

  [[nodiscard]] pinned_arena_stats stats() const;
  /// @brief The node the arena is bound to (OS index).
  [[nodiscard]] unsigned numa_node() const noexcept;
  /// @brief Whether the strict NUMA binding took effect (false: the OS refused; see the log).
  [[nodiscard]] bool bound() const noexcept;
  /// @brief Whether the pages are page-locked.
  [[nodiscard]] bool locked() const noexcept;
  /// @brief The whole mapped range.
  [[nodiscard]] std::span<std::byte> memory() const noexcept;
  [[nodiscard]] const device& get_device() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace taskswap
