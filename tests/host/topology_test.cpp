// SPDX-License-Identifier: Apache-2.0
#include "host/host_task_arena.hpp"
#include "host/topology.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace taskswap::test {
namespace {

TEST(topology, ReportsEveryNumaNodeWithMemoryAndCpus)
{
  const topology_report report = describe_topology();
  ASSERT_FALSE(report.nodes.empty());
  std::size_t cpus = 0;
  for (const auto& node : report.nodes) {
    EXPECT_GT(node.memory_bytes, 0U) << "node " << node.os_index;
    cpus += node.cpus.size();
  }
  EXPECT_GE(cpus, 1U);
  const std::string text = report.text();
  EXPECT_NE(text.find("node " + std::to_string(report.nodes.front().os_index) + ":"), std::string::npos) << text;
}

TEST(topology, EmulatedDeviceFallsBackToTheCallingThreadsNodeAndSaysSo)
{
  const device dev = emulated_device({.memory_bytes = 1 << 20});
  const device_locality locality = locality_of(dev);
  EXPECT_FALSE(locality.from_device);
  ASSERT_FALSE(locality.numa_nodes.empty());
  EXPECT_TRUE(detail::topology::instance().has_node(locality.numa_nodes.front()));
  EXPECT_FALSE(locality.cpus.empty());
  EXPECT_NE(locality.source.find("fallback"), std::string::npos) << locality.source;
  EXPECT_NE(locality.source.find("has no PCI location"), std::string::npos) << locality.source;

  const std::vector<device> devices{dev};
  const topology_report report = describe_topology(devices);
  ASSERT_EQ(report.devices.size(), 1U);
  EXPECT_EQ(report.devices.front().first, dev.name());
  EXPECT_NE(report.text().find(dev.name() + " -> node"), std::string::npos) << report.text();
}

TEST(host_task_arena, HonoursTheThreadCountAndLogsTheMissingNumaSupportOnce)
{
  std::mutex mutex;
  std::vector<std::string> messages;
  const log_handler previous = set_log_handler([&](log_level, std::string_view text) {
    const std::lock_guard lock(mutex);
    messages.emplace_back(text);
  });
  const unsigned node = detail::topology::instance().nodes().front().os_index;
  detail::host_task_arena one(static_cast<int>(node), 1);
  detail::host_task_arena two(static_cast<int>(node), 2);
  set_log_handler(previous);
  EXPECT_EQ(one.concurrency(), 1);
  EXPECT_EQ(two.concurrency(), 2);
  std::atomic<int> ran{0};
  one.execute([&] { ++ran; });
  EXPECT_EQ(ran.load(), 1);
  std::size_t tbbbind_notes = 0;
  for (const auto& m : messages) { tbbbind_notes += m.find("tbbbind") != std::string::npos ? 1U : 0U; }
  EXPECT_LE(tbbbind_notes, 1U);
  if (!one.numa_constrained()) { EXPECT_FALSE(two.numa_constrained()); }
}

}  // namespace
}  // namespace taskswap::test
