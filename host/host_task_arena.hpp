// SPDX-License-Identifier: Apache-2.0
#pragma once

// A oneTBB task arena whose threads run on one NUMA node: used for pre-faulting the pinned arena
// and for the CPU optimizer. Without NUMA information in oneTBB (no tbbbind library), the arena
// is unconstrained and that is logged once per process.

#include <oneapi/tbb/task_arena.h>

#include <utility>

namespace taskswap::detail {

class host_task_arena {
 public:
  /// @param numa_node OS index of the node, or -1 for no constraint
  /// @param threads   concurrency; 0 for the node's (or the machine's) default
  host_task_arena(int numa_node, int threads);

  /// Runs `f` inside the arena and waits for it.
  template <typename F>
  decltype(auto) execute(F&& f)
  {
    return arena_.execute(std::forward<F>(f));
  }

  [[nodiscard]] int concurrency() const { return arena_.max_concurrency(); }
  [[nodiscard]] bool numa_constrained() const noexcept { return constrained_; }
  [[nodiscard]] int numa_node() const noexcept { return numa_node_; }

 private:
  int numa_node_;
  bool constrained_ = false;
  oneapi::tbb::task_arena arena_;
};

}  // namespace taskswap::detail
