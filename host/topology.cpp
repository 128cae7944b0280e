// SPDX-License-Identifier: Apache-2.0
#include "host/topology.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"

#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>

namespace taskswap::detail {

namespace {

struct bitmap_deleter {
  void operator()(hwloc_bitmap_s* b) const noexcept { hwloc_bitmap_free(b); }
};
using bitmap = std::unique_ptr<hwloc_bitmap_s, bitmap_deleter>;

bitmap make_bitmap()
{
  bitmap b(hwloc_bitmap_alloc());
  if (!b) { throw out_of_memory("taskswap: hwloc_bitmap_alloc failed", sizeof(void*), 0, 0); }
  return b;
}

[[noreturn]] void throw_hwloc(const char* call, int code)
{
  throw error(message("taskswap: hwloc call ", call, " failed: ", std::strerror(code)));
}

hwloc_obj_t numa_node_object(hwloc_topology_t t, unsigned os_index)
{
  hwloc_obj_t node = nullptr;
  while ((node = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, node)) != nullptr) {
    if (node->os_index == os_index) { return node; }
  }
  return nullptr;
}

}  // namespace

std::vector<unsigned> bitmap_indexes(hwloc_const_bitmap_t set)
{
  std::vector<unsigned> indexes;
  for (int i = hwloc_bitmap_first(set); i >= 0; i = hwloc_bitmap_next(set, i)) {
    indexes.push_back(static_cast<unsigned>(i));
  }
  return indexes;
}

topology& topology::instance()
{
  // Never destroyed: arenas destroyed during static destruction may still query it, and hwloc's
  // PCI plugin is not unloaded behind them.
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): intentionally immortal
  static topology* const loaded = new topology();
  return *loaded;
}

topology::topology()
{
  if (hwloc_topology_init(&topology_) != 0) { throw_hwloc("hwloc_topology_init", errno); }
  // Keep PCI devices (GPUs, NICs) so a device's PCI bus id finds its place in the tree.
  if (hwloc_topology_set_io_types_filter(topology_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0 ||
      hwloc_topology_load(topology_) != 0) {
    const int code = errno;
    hwloc_topology_destroy(topology_);
    throw_hwloc("hwloc_topology_load", code);
  }
}

topology::~topology() { hwloc_topology_destroy(topology_); }

std::vector<numa_node_info> topology::nodes() const
{
  std::vector<numa_node_info> result;
  hwloc_obj_t node = nullptr;
  while ((node = hwloc_get_next_obj_by_type(topology_, HWLOC_OBJ_NUMANODE, node)) != nullptr) {
    result.push_back(
      {node->os_index, static_cast<std::size_t>(node->attr->numanode.local_memory), bitmap_indexes(node->cpuset)});
  }
  return result;
}

bool topology::has_node(unsigned os_index) const { return numa_node_object(topology_, os_index) != nullptr; }

std::vector<unsigned> topology::cpus_of_node(unsigned os_index) const
{
  const hwloc_obj_t node = numa_node_object(topology_, os_index);
  return node == nullptr ? std::vector<unsigned>{} : bitmap_indexes(node->cpuset);
}

device_locality topology::calling_thread_locality(const std::string& why) const
{
  auto cpus = make_bitmap();
  auto nodes = make_bitmap();
  device_locality locality;
  if (hwloc_get_last_cpu_location(topology_, cpus.get(), HWLOC_CPUBIND_THREAD) != 0 ||
      hwloc_bitmap_iszero(cpus.get())) {
    hwloc_bitmap_copy(cpus.get(), hwloc_topology_get_topology_cpuset(topology_));
  }
  hwloc_cpuset_to_nodeset(topology_, cpus.get(), nodes.get());
  locality.numa_nodes = bitmap_indexes(nodes.get());
  if (locality.numa_nodes.empty()) { locality.numa_nodes.push_back(0); }
  locality.cpus = cpus_of_node(locality.numa_nodes.front());
  locality.from_device = false;
  locality.source = message("fallback: ", why, "; using node ", locality.numa_nodes.front(), " of the calling thread");
  return locality;
}

device_locality topology::locality_of(const device& dev) const
{
  const std::string bus_id = dev.pci_bus_id();
  if (bus_id.empty()) { return calling_thread_locality(message(dev.name(), " has no PCI location")); }
  const std::lock_guard lock(mutex_);
  hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(topology_, bus_id.c_str());
  if (pci == nullptr) { return calling_thread_locality(message("hwloc does not list PCI device ", bus_id)); }
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topology_, pci);
  if (ancestor == nullptr || ancestor->nodeset == nullptr || hwloc_bitmap_iszero(ancestor->nodeset)) {
    return calling_thread_locality(message("no NUMA locality for PCI device ", bus_id));
  }
  device_locality locality;
  locality.numa_nodes = bitmap_indexes(ancestor->nodeset);
  locality.cpus = bitmap_indexes(ancestor->cpuset);
  locality.from_device = true;
  locality.source = message("PCI ", bus_id);
  return locality;
}

bool topology::bind_area(const void* p, std::size_t bytes, unsigned node_os_index) const
{
  auto nodes = make_bitmap();
  hwloc_bitmap_only(nodes.get(), node_os_index);
  const std::lock_guard lock(mutex_);
  return hwloc_set_area_membind(topology_, p, bytes, nodes.get(), HWLOC_MEMBIND_BIND,
                                HWLOC_MEMBIND_STRICT | HWLOC_MEMBIND_BYNODESET) == 0;
}

std::vector<unsigned> topology::memory_location(const void* p, std::size_t bytes) const
{
  auto nodes = make_bitmap();
  const std::lock_guard lock(mutex_);
  if (hwloc_get_area_memlocation(topology_, p, bytes, nodes.get(), HWLOC_MEMBIND_BYNODESET) != 0) {
    throw_hwloc("hwloc_get_area_memlocation", errno);
  }
  return bitmap_indexes(nodes.get());
}

bool topology::bind_thread_to_node(unsigned node_os_index) const
{
  const hwloc_obj_t node = numa_node_object(topology_, node_os_index);
  if (node == nullptr) { return false; }
  return hwloc_set_cpubind(topology_, node->cpuset, HWLOC_CPUBIND_THREAD) == 0;
}

}  // namespace taskswap::detail

namespace taskswap {

device_locality locality_of(const device& dev) { return detail::topology::instance().locality_of(dev); }

topology_report describe_topology(std::span<const device> devices)
{
  const auto& t = detail::topology::instance();
  topology_report report;
  report.nodes = t.nodes();
  for (const auto& dev : devices) { report.devices.emplace_back(dev.name(), t.locality_of(dev)); }
  return report;
}

namespace {
std::string index_list(const std::vector<unsigned>& indexes)
{
  // "0-3,8" style ranges.
  std::ostringstream out;
  for (std::size_t i = 0; i < indexes.size();) {
    std::size_t j = i;
    while (j + 1 < indexes.size() && indexes[j + 1] == indexes[j] + 1) { ++j; }
    out << (i > 0 ? "," : "") << indexes[i];
    if (j > i) { out << "-" << indexes[j]; }
    i = j + 1;
  }
  return out.str();
}
}  // namespace

std::string topology_report::text() const
{
  std::ostringstream out;
  out << "NUMA nodes\n";
  for (const auto& node : nodes) {
    out << "  node " << node.os_index << ": " << detail::bytes_text(node.memory_bytes) << ", cpus "
        << index_list(node.cpus) << "\n";
  }
  if (!devices.empty()) { out << "devices\n"; }
  for (const auto& [name, locality] : devices) {
    out << "  " << name << " -> node " << index_list(locality.numa_nodes) << ", cpus " << index_list(locality.cpus)
        << " (" << locality.source << ")\n";
  }
  return out.str();
}

}  // namespace taskswap
