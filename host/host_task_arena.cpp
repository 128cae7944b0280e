// SPDX-License-Identifier: Apache-2.0
#include "host/host_task_arena.hpp"

#include "device/log.hpp"
#include "device/message.hpp"

#include <oneapi/tbb/info.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace taskswap::detail {

namespace {

// TASKSWAP_TBB_NUMA=off keeps oneTBB from loading tbbbind at all: oneTBB opens it with
// RTLD_DEEPBIND, which AddressSanitizer and ThreadSanitizer refuse (the sanitizer presets set it).
bool tbb_numa_disabled()
{
  const char* setting = std::getenv("TASKSWAP_TBB_NUMA");
  return setting != nullptr && std::string_view(setting) == "off";
}

// oneTBB knows NUMA nodes only through its tbbbind library (hwloc underneath); without it,
// numa_nodes() is {-1}.
bool tbb_knows_node(int numa_node)
{
  if (tbb_numa_disabled()) { return false; }
  const auto known = oneapi::tbb::info::numa_nodes();
  return std::find(known.begin(), known.end(), numa_node) != known.end();
}

oneapi::tbb::task_arena::constraints constraints_for(int numa_node, int threads, bool constrained)
{
  oneapi::tbb::task_arena::constraints c;
  if (constrained) { c.numa_id = numa_node; }
  c.max_concurrency = threads > 0 ? threads : oneapi::tbb::task_arena::automatic;
  return c;
}

}  // namespace

host_task_arena::host_task_arena(int numa_node, int threads)
    : numa_node_(numa_node),
      constrained_(numa_node >= 0 && tbb_knows_node(numa_node)),
      arena_(constraints_for(numa_node, threads, constrained_))
{
  if (numa_node >= 0 && !constrained_) {
    log_once(
      "tbb-numa", log_level::info,
      message(tbb_numa_disabled() ? "TASKSWAP_TBB_NUMA=off" : "oneTBB has no NUMA information (tbbbind not loaded)",
              "; host threads for node ", numa_node,
              " run unconstrained, memory placement still follows the arena's hwloc binding"));
  }
  arena_.initialize();
}

}  // namespace taskswap::detail
