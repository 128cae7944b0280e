// SPDX-License-Identifier: Apache-2.0
#pragma once

// The swap engine: which units are on the device. It fills slots from home and writes them back,
// evicts by the residency model's Belady rule (conservative for a prefetch), makes room, narrows
// a frozen use's slot, and prefetches what the plan needs next. It owns the resident set, the
// device pool's slot-to-unit map and the waits the next write into pool memory must follow; it
// changes a unit's slot content and coherence (Note [Unit states]) and never its step phase. The
// step protocol (runtime::impl) calls it; it calls back nothing. A swap-in whose slot the pool's
// mapping thread is still mapping has its copy queued later (settle, issue_ready_fills).

#include "runtime/pool/device_pool.hpp"
#include "runtime/residency/plan_queue.hpp"
#include "runtime/residency/residency_model.hpp"
#include "runtime/swap/step_ledger.hpp"
#include "runtime/trace.hpp"
#include "runtime/swap/unit_record.hpp"

#include <taskswap/device.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace taskswap::detail {

class swap_engine {
 public:
  /// A swap-in that takes no victim's extents part by part (Note [Handoff]).
  static constexpr std::uint32_t no_handoff = ~std::uint32_t{0};
  /// What it works with, owned by the runtime and outliving it. The values (path, tracks)
  /// are copied at construction: they are fixed for a runtime's life.
  struct parts {
    const device& dev;
    std::deque<unit_record>& units;
    const plan_queue& plan;
    const residency_model& model;
    device_pool& pool;
    step_ledger& ledger;
    stream& h2d;  // swap-ins, parameter uploads
    stream& fill_order;  // the waits of swap-ins whose copies wait for their mappings
    stream& d2h;  // write-backs
    trace_recorder* trace;  // null without [runtime] trace
    int h2d_track;
    int d2h_track;
    step_path path;
  };
  explicit swap_engine(parts p);

  /// Why room is made (Note [Prefetch victims]).
  enum class room_for : std::uint8_t {
    acquire,  // the trainer needs the unit now: any unit not held may go, frozen uses narrow
    prefetch_this_step,  // a later use in the step in progress: the units held now stay held past it
    prefetch_later,  // a use in a later step: the units held now are released before it
  };
  /// Brings `r` in for the use at position `use` of the plan: its whole slot, or its parameters
  /// alone (`whole` false, a frozen use). `fill` false (an activation block's stash, or a
  /// prefetch for one): the slot is mapped and ordered on h2d after its memory's earlier users as
  /// a fill is (its `arrived` follows them), nothing copied, and it stays `unwritten` until the
  /// stash's acquire. False where the room cannot be found.
  bool swap_in(unit_record& r, std::uint64_t use, room_for why, bool whole, bool fill = true);
  /// A zeroed gradient slab alone for `r` (a host update of another rank's training), for an
  /// acquire at `use`, ready for `user` to read. False where the room cannot be found.
  bool swap_in_grads(unit_record& r, std::uint64_t use, stream_view user);
  /// Copies the travelling prefix of the home block into the (mapped) slot of `r`.
  void fill_slot(unit_record& r);
  /// Queues the copies of the swap-ins whose slots the mapping thread has mapped since.
  void issue_ready_fills();
  /// Makes sure the swap-in of `r`, if one is waiting for its mapping, has its copy queued (waiting
  /// for the mapping thread where it must): before anything uses or moves its slot.
  void settle(unit_record& r);
  /// settle() for every unit.
  void settle_all();
  void write_back(unit_record& r);
  void evict(unit_record& r);
  /// Brings in the upcoming units in the order of their use, as far as each one's lookahead and
  /// the budget allow.
  void prefetch();
  /// Makes h2d wait for every earlier use of pool memory before the next write into it.
  void flush_h2d_waits();
  /// Counts the pool's bytes in use now (the step's peak) and traces them.
  void note_device_bytes();

 private:
  bool make_room(const unit_record& r, std::size_t bytes, std::uint64_t use, room_for why);
  device_pool::mapping map_slot(unit_record& r, std::size_t bytes, std::size_t keep);
  /// Orders r's fill on `on` (h2d, or fill_order for a copy queued later) after the waits it
  /// needs: every pending one (all_waits), or those of the units whose memory its slot took, but
  /// for the write-back of `from` (no_handoff: none).
  void order_fill(const unit_record& r, std::uint32_t from, stream& on);
  static constexpr std::uint32_t all_waits = no_handoff - 1;
  void flush_h2d_waits_for(const unit_record& r, std::uint32_t from, stream& on);
  void enqueue_fill(unit_record& r, std::uint32_t from);
  [[nodiscard]] std::uint32_t handoff_from(const unit_record& r) const;
  unit_record* pick_victim(const unit_record& coming, std::uint64_t use, room_for why);
  void narrow_to_params(unit_record& r);
  void add_resident(unit_record& r);
  void remove_resident(unit_record& r);
  template <class Move>
  void go(unit_record& r, Move m)
  {
    r.go(m, p_.path);
  }

  parts p_;
  std::vector<std::uint32_t> unit_of_slot_;  // device pool slot -> unit
  std::vector<std::uint32_t> resident_;  // non-pinned resident units
  std::vector<victim_candidate> victim_candidates_;  // pick_victim's, kept to reuse its memory
  // Must precede the next write into the memory of `unit`'s slot (no_handoff: into any pool memory).
  struct h2d_wait {
    std::uint32_t unit = no_handoff;
    const event* e = nullptr;
  };
  std::vector<h2d_wait> h2d_waits_;
  std::vector<device_pool::slot_id> sharers_;  // flush_h2d_waits_for's, kept to reuse its memory
  std::vector<std::uint32_t> stashed_ahead_;  // prefetch's: activation blocks with a stash ahead of the use seen
  std::vector<std::uint32_t> room_victims_;  // the units make_room() evicted for the swap-in in progress
  // Swap-ins decided and ordered on h2d whose slots the mapping thread has still to map: their
  // copies are queued once it has (Note [Mapping off the trainer's thread]), in this order.
  struct pending_fill {
    std::uint32_t unit = 0;
    device_pool::ticket ready = 0;
    std::uint32_t from = no_handoff;  // the victim whose extents it takes as they are written back
  };
  std::deque<pending_fill> pending_fills_;
  /// Queues the copy of a swap-in that waited for its mapping, after its waits.
  void enqueue_pending(const pending_fill& f);
};

}  // namespace taskswap::detail
