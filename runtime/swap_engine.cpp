// SPDX-License-Identifier: Apache-2.0
// Residency: filling and writing back slots, eviction by Belady's rule, making room, prefetch.

#include "runtime/runtime_impl.hpp"

#include "kernels/kernels.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

namespace taskswap {

using detail::ensure;

void runtime::impl::flush_h2d_waits()
{
  for (const event* e : h2d_waits_) {
    if (!e->query()) { e->wait(h2d_); }  // a finished event orders nothing: skip the enqueue
  }
  h2d_waits_.clear();
}

void runtime::impl::note_device_bytes()
{
  const std::size_t used = pool_->stats().used;
  current_.peak_device_bytes = std::max(current_.peak_device_bytes, used);
  if (trace_) { trace_->counter("device bytes", static_cast<double>(used)); }
}

void runtime::impl::add_resident(unit_record& r)
{
  r.resident_index = resident_.size();
  resident_.push_back(r.index);
}

void runtime::impl::remove_resident(unit_record& r)
{
  const std::uint32_t last = resident_.back();
  resident_[r.resident_index] = last;
  units_[last].resident_index = r.resident_index;
  resident_.pop_back();
}

// Copies the travelling prefix of the home block into the unit's slot and zeroes its gradients
// (or, for a slot of the parameters alone, copies those), on h2d, after every pending reuse of
// pool memory and every pending write of this home block.
void runtime::impl::fill_slot(unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  flush_h2d_waits();
  for (const std::optional<event>* e : {&r.written_back, &r.host_updated}) {
    if (*e && (*e)->recorded() && !(*e)->query()) { (*e)->wait(h2d_); }
  }
  const std::size_t bytes = r.params_only ? l.params_bytes : l.travel_bytes;  // the params lie first in both
  const std::size_t span = trace_ ? trace_->open(h2d_track_, "swap-in " + r.name, h2d_) : 0;
  r.stage_in(0, r.slot->subspan(0, bytes), h2d_);
  if (!r.params_only) { fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, h2d_); }
  r.arrived.record(h2d_);
  if (trace_) { trace_->close(span, h2d_); }
  r.dirty = false;
  r.params_stale = false;
  r.stepped_here = false;
  ++r.swap_ins;
  ++current_.swap_ins;
  current_.h2d_bytes += bytes;
}

void runtime::impl::write_back(unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  if (r.released.recorded() && !r.released.query()) { r.released.wait(d2h_); }
  const std::size_t span = trace_ ? trace_->open(d2h_track_, "write-back " + r.name, d2h_) : 0;
  r.write_home(0, const_device_span(r.slot->subspan(0, l.writeback_bytes)), d2h_);
  ensure(r.written_back, device_).record(d2h_);
  if (trace_) { trace_->close(span, d2h_); }
  r.dirty = false;
  ++r.write_backs;
  ++current_.write_backs;
  current_.d2h_bytes += l.writeback_bytes;
}

void runtime::impl::evict(unit_record& r)
{
  if (r.dirty) {
    write_back(r);
    h2d_waits_.push_back(&*r.written_back);  // recorded after d2h waited for the release
  } else {
    if (r.released.recorded()) { h2d_waits_.push_back(&r.released); }
    if (r.stepped_here) { h2d_waits_.push_back(&*r.grads_copied); }
  }
  pool_->unmap(r.pool_slot);
  r.slot.reset();
  r.grads_only = false;
  r.params_only = false;
  r.params_stale = false;
  remove_resident(r);
  ++current_.evictions;
  note_device_bytes();
}

// The victim, by the residency model's rule (Note [One residency model]): an acquire (a use now)
// may take any unit not held, by its next use; a prefetch for the use at `use` is conservative
// (Cao et al., 1995): it displaces the unit that Belady would displace when `use` comes, and only
// if that unit is neither held nor needed before then; otherwise it waits. So prefetching moves
// fetches earlier but never adds one. Among units used equally far after `use` (typically never
// again in the plan), those idle until `use` were released before the others will have been by
// then, so Belady at `use` takes one of them: a tie with a unit that is held or needed first does
// not stop the prefetch.
runtime::impl::unit_record* runtime::impl::pick_victim(std::uint64_t use, bool for_acquire)
{
  victim_candidates_.clear();
  for (const std::uint32_t i : resident_) {
    const unit_record& r = units_[i];
    if (for_acquire && r.held) { continue; }
    const std::uint64_t next = for_acquire ? plan_.next_use(unit_id{i}) : plan_.next_use_after(unit_id{i}, use);
    const bool idle = for_acquire || (!r.held && plan_.next_use(unit_id{i}) >= use);
    victim_candidates_.push_back({.unit = i, .next_use = next, .last_release = r.last_release, .idle = idle});
  }
  const std::size_t k = detail::residency_model::choose_victim(victim_candidates_);
  return k == victim_candidates_.size() ? nullptr : &units_[victim_candidates_[k].unit];
}

// A unit held for a frozen use in its whole slot gives up everything but its parameters: the plan
// check counted only those. What changed is written home first; the freed tail is reused only
// after that copy and the unit's previous uses of it.
void runtime::impl::narrow_to_params(unit_record& r)
{
  if (r.dirty) {
    write_back(r);
    h2d_waits_.push_back(&*r.written_back);
  }
  if (r.released.recorded()) { h2d_waits_.push_back(&r.released); }
  if (r.stepped_here) { h2d_waits_.push_back(&*r.grads_copied); }
  const std::size_t keep = r.layout.params_bytes;
  held_bytes_ -= r.held_bytes - taken(keep);
  r.held_bytes = taken(keep);
  r.slot = pool_->shrink(r.pool_slot, keep);
  r.params_only = true;
  note_device_bytes();
}

// The slot moves to other granules only after its previous users are done: a host wait, rarely
// more than a query (the unit left the device at least one swap earlier), bounded by
// [runtime] timeout as every other wait of the runtime is. One thread uses the pool, so holding
// its lock meanwhile stops nobody.
device_span runtime::impl::map_slot(unit_record& r, std::size_t bytes)
{
  // The units whose earlier uses of the addresses must be done: r itself, or for a packed unit
  // the units that had places in the class granule that moves.
  return pool_->map(r.pool_slot, bytes, [&](detail::device_pool::slot_id slot) {
    if (slot >= unit_of_slot_.size() || unit_of_slot_[slot] >= units_.size()) { return; }  // staging: never used
    const unit_record& u = units_[unit_of_slot_[slot]];
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    const auto wait = [&](const event& e, const char* what) {
      if (!e.recorded() || e.query()) { return; }
      const auto left =
        std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero());
      if (!e.synchronize_for(left)) {
        stalled(detail::message("moving device memory that '", u.name, "' used: its previous use (", what,
                                ") has not finished within ", options_.timeout.count(),
                                " ms ([runtime] timeout); the trainer's stream or a copy is stalled"));
      }
    };
    wait(u.arrived, "swap-in");
    wait(u.released, "release");
    for (const auto& [e, what] :
         {std::pair{&u.written_back, "write-back"}, std::pair{&u.grads_copied, "gradients home"},
          std::pair{&u.grads_ready_event, "gradients ready"}, std::pair{&u.grads_done, "reduction"}}) {
      if (*e) { wait(**e, what); }
    }
  });
}

bool runtime::impl::make_room(const unit_record& r, std::size_t bytes, std::uint64_t use, bool for_acquire)
{
  const auto fits = [&] {
    if (r.packed) { return r.resident() || pool_->fits(r.pool_slot, bytes); }  // resident: its own place frees
    const std::size_t freed_later = r.resident() ? taken(r.slot->size()) : 0;
    return pool_->free() + freed_later >= taken(bytes);
  };
  while (true) {
    if (fits()) { return true; }
    if (unit_record* victim = pick_victim(use, for_acquire)) {
      evict(*victim);
      continue;
    }
    if (!for_acquire) { return false; }  // a prefetch never narrows what the trainer holds
    // A unit held frozen in its whole slot: a clean one first (nothing to write home), then the
    // lowest unit id (the order the planner replays).
    unit_record* wide = nullptr;
    for (const std::uint32_t i : resident_) {
      unit_record& h = units_[i];
      if (!h.held || !h.frozen || h.frozen_reduced || h.params_only || h.packed) { continue; }  // a place cannot narrow
      if (wide == nullptr || std::pair(h.dirty, h.index) < std::pair(wide->dirty, wide->index)) { wide = &h; }
    }
    if (wide == nullptr) { return false; }
    narrow_to_params(*wide);
  }
}

bool runtime::impl::swap_in(unit_record& r, std::uint64_t use, bool for_acquire, bool whole)
{
  // Its parameters alone are here and it must come in whole: for an acquire, that copy goes first
  // (its room may be what the whole unit needs); a prefetch keeps it until the room is found.
  if (for_acquire && r.resident()) { evict(r); }
  const std::size_t bytes = whole ? r.layout.device_bytes : r.layout.params_bytes;
  if (!make_room(r, bytes, use, for_acquire)) { return false; }  // counting what r gives up below
  if (r.resident()) { evict(r); }
  r.slot = map_slot(r, bytes);
  r.params_only = !whole;
  add_resident(r);
  fill_slot(r);
  note_device_bytes();
  return true;
}

// Brings in the upcoming units in the order of their use, as far as each one's lookahead and the
// budget allow; stops at the first that does not fit, so no later unit takes its room.
void runtime::impl::prefetch()
{
  plan_.for_each_upcoming(max_lookahead_, [&](unit_id u, detail::planned_acquisition a, std::size_t distance) {
    unit_record& r = units_[u.value];
    const bool whole = a.whole();
    if (r.resident_for(whole)) { return true; }
    if (r.policy.residency != residency::prefetch) { return true; }
    if (distance > static_cast<std::size_t>(r.policy.lookahead)) { return true; }
    if (r.held) { return false; }  // its parameters are in use: it comes in whole at its acquire, first
    return swap_in(r, a.position, false, whole);
  });
}

}  // namespace taskswap
