// SPDX-License-Identifier: Apache-2.0
#pragma once

// Parts of runtime::impl that live and die together: its streams, its residency inputs, and the
// memory its units occupy.
//
// Note [Streams]
// The trainer's compute stream(s); `h2d` for swap-ins and parameter uploads; `d2h` for
// write-backs and, for host placement, gradients coming home; `host_opt`, whose host functions
// run the CPU AdamW; `aux`, with a communicator or guarded steps, for the updates the runtime
// applies itself. Every dependency between them is an event:
//   swap-in:    h2d waits for the events of the units whose memory it reuses (their release, and
//               their write-back or gradient copy), and for the unit's own pending write-back or
//               CPU step (its home copy is being written); then copies and records `arrived`.
//               Where its copy waits for its slot's mapping, `fill_order` waits for those events
//               when the swap-in is decided, and h2d for `fill_order` when the copy is queued.
//   acquire:    the compute stream waits on `arrived`.
//   release:    records `released` on the compute stream.
//   write-back: d2h waits on `released`, copies home, records `written_back`.
//   host step:  d2h waits on the step's point in the compute stream (`grads_done`), copies the
//               gradients home, zeroes them, records `grads_copied`; host_opt waits, runs the CPU
//               AdamW, records `host_updated`; the next upload of the parameters waits for it.
// Decisions (what to bring in, what to evict, where it goes) are made on the host from the plan
// and never wait for the device.

#include "host/host_task_arena.hpp"
#include "runtime/homes/home_tier.hpp"
#include "runtime/pool/device_pool.hpp"
#include "runtime/residency/plan_queue.hpp"
#include "runtime/residency/residency_model.hpp"

#include <taskswap/device.hpp>

#include <cstddef>
#include <optional>

namespace taskswap::detail {

/// The runtime's own streams (Note [Streams]). The CPU optimizer's threads come first: a
/// stream's destruction lets its queued work finish, and that work may run on them.
struct runtime_streams {
  explicit runtime_streams(const device& dev) : h2d(dev), fill_order(dev), d2h(dev), host_opt(dev) {}

  std::optional<host_task_arena> cpu;  // with host placement: the CPU AdamW's threads
  stream h2d;
  stream fill_order;  // the waits of swap-ins queued on h2d later (Note [Swap-ins waiting for a mapping])
  stream d2h;
  stream host_opt;
  std::optional<stream> aux;  // with a communicator or guarded steps
};

/// What residency is decided from: the budget's rules (made once the units are registered) and
/// the plan.
struct residency_inputs {
  explicit residency_inputs(std::size_t units) : plan(units) {}

  std::optional<residency_model> model;  // the budget's rules, the plan check, Belady
  plan_queue plan;
};

/// Where the units' bytes are: their homes (Note [Home tiers]) and the device pool's slots (made
/// once the units are known to be valid).
struct unit_memory {
  home_store homes;
  std::optional<device_pool> pool;
};

}  // namespace taskswap::detail
