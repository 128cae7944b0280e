// SPDX-License-Identifier: Apache-2.0
#pragma once

// The machine's hwloc topology, loaded once per process with I/O discovery (PCI devices), and
// the queries the host layer needs. hwloc topologies are safe to query from several threads once
// loaded; binding calls are serialised here anyway.

#include <taskswap/host.hpp>

#include <hwloc.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace taskswap::detail {

class topology {
 public:
  /// The process-wide topology.
  static topology& instance();

  topology(const topology&) = delete;
  topology& operator=(const topology&) = delete;
  topology(topology&&) = delete;
  topology& operator=(topology&&) = delete;
  ~topology();

  [[nodiscard]] hwloc_topology_t handle() const noexcept { return topology_; }
  [[nodiscard]] std::vector<numa_node_info> nodes() const;
  [[nodiscard]] bool has_node(unsigned os_index) const;
  [[nodiscard]] std::vector<unsigned> cpus_of_node(unsigned os_index) const;
  [[nodiscard]] device_locality locality_of(const device& dev) const;

  /// Binds [p, p + bytes) to the node, strictly; false (and errno) when the OS refuses.
  [[nodiscard]] bool bind_area(const void* p, std::size_t bytes, unsigned node_os_index) const;
  /// The OS indexes of the nodes where the pages of [p, p + bytes) live now.
  [[nodiscard]] std::vector<unsigned> memory_location(const void* p, std::size_t bytes) const;
  /// Binds the calling thread to the CPUs of the node; false when the OS refuses.
  [[nodiscard]] bool bind_thread_to_node(unsigned node_os_index) const;

 private:
  topology();
  [[nodiscard]] device_locality calling_thread_locality(const std::string& why) const;
  hwloc_topology_t topology_ = nullptr;
  mutable std::mutex mutex_;
};

/// The OS indexes set in an hwloc bitmap.
[[nodiscard]] std::vector<unsigned> bitmap_indexes(hwloc_const_bitmap_t set);

}  // namespace taskswap::detail
