// SPDX-License-Identifier: Apache-2.0
#pragma once

// A oneTBB task arena whose threads run on one NUMA node: used for pre-faulting the pinned arena
// and for the CPU optimizer. Without NUMA information in oneTBB (no tbbbind library), the arena
// is unconstrained and that is logged once per process.

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <atomic>
#include <cstddef>
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

  /// Runs body(first, last) over chunk indexes [0, chunks) in parallel inside the arena, split
  /// evenly over its threads, and waits. Everything the caller wrote before the call is visible
  /// to the bodies, and everything the bodies wrote is visible after it, through an explicit
  /// release/acquire pair: oneTBB's own hand-off gives the same guarantee, but ThreadSanitizer
  /// cannot see it in an uninstrumented libtbb and would report every element as a race.
  template <typename Body>
  void parallel_for(std::size_t chunks, Body&& body)
  {
    std::atomic<std::size_t> published{chunks};
    std::atomic<std::size_t> finished{0};
    published.store(chunks, std::memory_order_release);
    arena_.execute([&] {
      oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<std::size_t>(0, chunks),
        [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
          static_cast<void>(published.load(std::memory_order_acquire));
          body(r.begin(), r.end());
          finished.fetch_add(1, std::memory_order_release);
        },
        oneapi::tbb::static_partitioner{});
    });
    static_cast<void>(finished.load(std::memory_order_acquire));
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
