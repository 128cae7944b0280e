// SPDX-License-Identifier: Apache-2.0
// Residency: filling and writing back slots, eviction by Belady's rule, making room, prefetch.

#include "runtime/swap/swap_engine.hpp"

#include "device/message.hpp"

#include "kernels/kernels.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

namespace taskswap::detail {
namespace {

// Marks a unit as being swapped in for as long as the scope lasts (unit_record::incoming), or
// until its copy is queued where keep() says that it waits for its mapping.
class incoming_scope {
 public:
  explicit incoming_scope(unit_record& r) : r_(r) { r_.incoming = true; }
  ~incoming_scope()
  {
    if (!kept_) { r_.incoming = false; }
  }
  incoming_scope(const incoming_scope&) = delete;
  incoming_scope& operator=(const incoming_scope&) = delete;
  incoming_scope(incoming_scope&&) = delete;
  incoming_scope& operator=(incoming_scope&&) = delete;
  void keep() noexcept { kept_ = true; }

 private:
  unit_record& r_;
  bool kept_ = false;
};

}  // namespace

swap_engine::swap_engine(parts p) : p_(p)
{
  for (const unit_record& r : p_.units) {
    if (r.pinned()) { continue; }
    unit_of_slot_.resize(std::max<std::size_t>(unit_of_slot_.size(), r.pool_slot + 1), ~std::uint32_t{0});
    unit_of_slot_[r.pool_slot] = r.index;
  }
}

void swap_engine::flush_h2d_waits()
{
  // Waits that swap-ins still waiting for their mappings took onto fill_order: the last one's
  // event follows them all (Note [Swap-ins waiting for a mapping]).
  if (!pending_fills_.empty()) { p_.units[pending_fills_.back().unit].fill_ordered->wait(p_.h2d); }
  for (const h2d_wait& w : h2d_waits_) {
    if (!w.e->query()) { w.e->wait(p_.h2d); }  // a finished event orders nothing: skip the enqueue
  }
  h2d_waits_.clear();
}

// The waits of the units whose memory the swap-in of `r` now holds: r's own, and those of the
// units that still map an extent r's slot took (device_pool::sharers). The others stay for
// whoever takes their extents, so a swap-in into idle extents does not wait for an unrelated
// write-back. r does not wait for the write-back of `from`, which it follows part by part (Note
// [Handoff]), but that wait stays for whoever takes the victim's other extents (r may map only
// some: a frozen layer taking a trained one's parameters). A finished one is dropped. Past 64
// waits, or where the sharers cannot be told, all the others are flushed.
void swap_engine::flush_h2d_waits_for(const unit_record& r, std::uint32_t from, stream& on)
{
  const bool known = !r.packed && h2d_waits_.size() <= 64 && p_.pool.sharers(r.pool_slot, sharers_);
  const event* handed = from != no_handoff ? &*p_.units[from].written_back : nullptr;
  auto kept = h2d_waits_.begin();
  for (const h2d_wait& w : h2d_waits_) {
    if (w.e->query()) { continue; }
    if (w.e == handed) {
      *kept++ = w;
      continue;
    }
    const bool shares = !known || w.unit == no_handoff || w.unit == r.index ||
                        std::find(sharers_.begin(), sharers_.end(), p_.units[w.unit].pool_slot) != sharers_.end();
    if (shares) {
      w.e->wait(on);
    } else {
      *kept++ = w;
    }
  }
  h2d_waits_.erase(kept, h2d_waits_.end());
}

void swap_engine::note_device_bytes()
{
  const std::size_t used = p_.pool.stats().used;
  p_.ledger.device_bytes(used);
  if (p_.trace != nullptr) { p_.trace->counter("device bytes", static_cast<double>(used)); }
}

void swap_engine::add_resident(unit_record& r)
{
  r.resident_index = resident_.size();
  resident_.push_back(r.index);
}

void swap_engine::remove_resident(unit_record& r)
{
  const std::uint32_t last = resident_.back();
  resident_[r.resident_index] = last;
  p_.units[last].resident_index = r.resident_index;
  resident_.pop_back();
}

// A swap-in's copy is ordered when it is decided and queued once its slot is mapped. Ordering
// puts on h2d, now, the waits for every pending reuse of pool memory and every pending write of
// this home block: they name events as they are recorded now, and a copy queued later on h2d
// follows them. The copy then fills the travelling prefix of the home block into the slot and
// zeroes its gradients (or, for a slot of the parameters alone, copies those).
void swap_engine::order_fill(const unit_record& r, std::uint32_t from, stream& on)
{
  if (from == all_waits) {
    flush_h2d_waits();
  } else {
    flush_h2d_waits_for(r, from, on);
  }
  for (const std::optional<event>* e : {&r.written_back, &r.host_updated}) {
    if (*e && (*e)->recorded() && !(*e)->query()) { (*e)->wait(on); }
  }
}

// Note [Swap-ins waiting for a mapping]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A swap-in's waits are put on a stream when it is decided (they name events as recorded now),
// and its copy is queued once the mapping thread has mapped its slot. Put on h2d, the waits of a
// swap-in decided later would hold up the copies, queued after them, of the swap-ins decided
// earlier whose mappings came late: a streamed trunk's forward prefetches a dozen layers ahead,
// each taking the room of the layer just released, so each layer's copy would wait for the
// release of the one before it and the forward would run copy, compute, copy. So where the copy
// cannot be queued at once, the waits go on `fill_order` instead, with an event after them
// (`fill_ordered`) that h2d waits for just before the copy. The waits of swap-ins decided later
// follow on fill_order and hold up nothing queued on h2d. h2d_waits_ drops a wait once it is on a
// stream either way; a wait for a victim whose extents the swap-in took only some of (or every
// wait, where the sharers cannot be told) then protects memory another write may take before
// that copy is queued, so a write into pool memory after every pending wait (flush_h2d_waits:
// a gradient slab for a host update, a broadcast's staging) first has h2d wait for the last
// pending swap-in's event.

// Note [Handoff]
// ~~~~~~~~~~~~~~
// A swap-in that makes its room by evicting a dirty unit takes that unit's extents: its copy in
// must not overwrite bytes the victim's write-back has still to read. Waiting for the whole
// write-back runs the two directions of the link one after the other. A write-back of a host
// home goes in parts instead (up to handoff_parts, of at least handoff_min_part bytes), with an
// event after each; where the swap-in maps extents of the victim at the same offsets as the
// victim did (device_pool::shares_aligned: units of one shape, or a layer whose parameters stayed
// taking the rest of its victim's slot), its copy goes in the same parts, each waiting for the
// write-back's part that ends at or past it. The directions then overlap but for one part.
// Its gradients' zeroing waits for the parts it overlaps, or for the first part (which follows
// the victim's last use) where it overlaps none. A disk home's block goes whole (a write of part
// of it would read the rest from the file first), and so does a packed slot's.
namespace {

constexpr std::size_t handoff_parts = 16;
// A copy costs a fixed time beyond its bytes (8 us on the H200, about 400 KB of its link): parts of
// 4 MiB pay under a tenth of that, parts of 1 MiB 40 %, which the link's slower direction then
// carries on every layer of a streamed trunk's backward.
constexpr std::size_t handoff_min_part = std::size_t{4} << 20;

std::size_t handoff_part_bytes(std::size_t bytes)
{
  constexpr std::size_t align = std::size_t{64} << 10;
  const std::size_t part = (bytes + handoff_parts - 1) / handoff_parts;
  return std::max(handoff_min_part, (part + align - 1) / align * align);
}

}  // namespace

void swap_engine::enqueue_fill(unit_record& r, std::uint32_t from)
{
  const detail::unit_layout& l = r.layout;
  // The params lie first in both; a slot mapped for a stash is the trainer's to write.
  const std::size_t bytes = r.unwritten ? 0 : r.params_only() ? l.params_bytes : l.travel_bytes;
  const std::size_t span = p_.trace != nullptr ? p_.trace->open(p_.h2d_track, "swap-in " + r.name, p_.h2d) : 0;
  const unit_record* x = from == no_handoff ? nullptr : &p_.units[from];
  const std::size_t part = x != nullptr ? x->written_part_bytes : bytes;
  std::size_t waited = 0;  // parts of x's write-back h2d waits for already
  // h2d waits until x's write-back has read what it reads of [begin, end): the last part that
  // reads some of it, or the first (after x's last use) where none does.
  const auto after_write_back = [&](std::size_t begin, std::size_t end) {
    if (x == nullptr) { return; }
    const std::size_t read = x->layout.writeback_bytes;
    const std::size_t k = begin >= read ? 0 : std::min(x->written_part_count - 1, (std::min(end, read) - 1) / part);
    if (k + 1 > waited) {
      x->written_parts[k].wait(p_.h2d);
      waited = k + 1;
    }
  };
  for (std::size_t at = 0; at < bytes; at += part) {
    const std::size_t n = std::min(part, bytes - at);
    after_write_back(at, at + n);
    r.stage_in(at, r.slot->subspan(at, n), p_.h2d);
  }
  if (!r.params_only()) {
    after_write_back(l.device_grads, l.device_grads + l.device_grad_bytes());
    fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, p_.h2d);
  }
  r.arrived.record(p_.h2d);
  r.incoming = false;  // its home block is read by h2d now, which the home tier was told
  if (p_.trace != nullptr) { p_.trace->close(span, p_.h2d); }
}

// The one victim of this swap-in whose extents `r` maps at the victim's offsets, written back in
// parts still in flight (Note [Handoff]); no_handoff otherwise.
std::uint32_t swap_engine::handoff_from(const unit_record& r) const
{
  if (room_victims_.size() != 1 || r.packed || r.home.cache != nullptr) { return no_handoff; }
  const unit_record& x = p_.units[room_victims_.front()];
  if (x.written_part_count < 2 || !x.written_back || x.written_back->query()) { return no_handoff; }
  if (!p_.pool.shares_aligned(r.pool_slot, x.pool_slot)) { return no_handoff; }
  return x.index;
}

void swap_engine::fill_slot(unit_record& r)
{
  order_fill(r, all_waits, p_.h2d);
  enqueue_fill(r, no_handoff);
  go(r, coherence_move::fill);
  p_.ledger.swap_in(r.index, r.params_only() ? r.layout.params_bytes : r.layout.travel_bytes);
}

void swap_engine::issue_ready_fills()
{
  while (!pending_fills_.empty() && p_.pool.ready(pending_fills_.front().ready)) {
    const pending_fill f = pending_fills_.front();
    pending_fills_.pop_front();
    enqueue_pending(f);
  }
}

void swap_engine::enqueue_pending(const pending_fill& f)
{
  unit_record& r = p_.units[f.unit];
  r.fill_ordered->wait(p_.h2d);
  enqueue_fill(r, f.from);
}

// The fills before r's go first (in order), each once its own mapping is done: a reused slot's
// ticket can be older than an earlier fill's.
void swap_engine::settle(unit_record& r)
{
  const auto it = std::find_if(pending_fills_.begin(), pending_fills_.end(),
                               [&](const pending_fill& f) { return f.unit == r.index; });
  if (it == pending_fills_.end()) { return; }
  for (auto n = it - pending_fills_.begin() + 1; n > 0; --n) {
    const pending_fill f = pending_fills_.front();
    p_.pool.wait(f.ready);
    pending_fills_.pop_front();
    enqueue_pending(f);
  }
}

void swap_engine::settle_all()
{
  if (!pending_fills_.empty()) { settle(p_.units[pending_fills_.back().unit]); }
}

void swap_engine::write_back(unit_record& r)
{
  // A home in the host cache takes a block there, by the cache's rules for the blocks in use: the
  // swap-ins decided before read theirs first, as they would have with no mapping to wait for.
  if (r.home.cache != nullptr) { settle_all(); }
  const detail::unit_layout& l = r.layout;
  if (r.released.recorded() && !r.released.query()) { r.released.wait(p_.d2h); }
  const std::size_t span = p_.trace != nullptr ? p_.trace->open(p_.d2h_track, "write-back " + r.name, p_.d2h) : 0;
  // In parts where a swap-in may take its extents as they go (Note [Handoff]).
  const std::size_t part = handoff_part_bytes(l.writeback_bytes);
  const bool in_parts = r.home.cache == nullptr && !r.packed && l.writeback_bytes > part;
  r.written_part_count = in_parts ? (l.writeback_bytes + part - 1) / part : 0;
  r.written_part_bytes = part;
  while (r.written_parts.size() < r.written_part_count) { r.written_parts.emplace_back(p_.dev); }
  for (std::size_t k = 0, at = 0; at < l.writeback_bytes; ++k, at += in_parts ? part : l.writeback_bytes) {
    const std::size_t n = in_parts ? std::min(part, l.writeback_bytes - at) : l.writeback_bytes;
    r.write_home(at, const_device_span(r.slot->subspan(at, n)), p_.d2h);
    if (in_parts) { r.written_parts[k].record(p_.d2h); }
  }
  ensure(r.written_back, p_.dev).record(p_.d2h);
  if (p_.trace != nullptr) { p_.trace->close(span, p_.d2h); }
  go(r, coherence_move::write_back);
  p_.ledger.write_back(r.index, l.writeback_bytes);
}

void swap_engine::evict(unit_record& r)
{
  settle(r);  // its copy goes before the copies of whoever takes its extents
  if (r.dirty()) {
    write_back(r);
    h2d_waits_.push_back({r.index, &*r.written_back});  // recorded after d2h waited for the release
  } else {
    r.written_part_count = 0;  // no write-back of this eviction to take its extents behind
    if (r.released.recorded()) { h2d_waits_.push_back({r.index, &r.released}); }
    // A write-back still in flight (an activation block's, sent at its stash's release) reads the slot.
    if (r.written_back && !r.written_back->query()) { h2d_waits_.push_back({r.index, &*r.written_back}); }
    if (r.host_stepped()) { h2d_waits_.push_back({r.index, &*r.grads_copied}); }
  }
  p_.pool.unmap(r.pool_slot);
  r.slot.reset();
  r.unwritten = false;
  go(r, slot_move::evict);
  go(r, coherence_move::drop);
  remove_resident(r);
  p_.ledger.eviction();
  note_device_bytes();
}

// The victim, by the residency model's rule (Note [One residency model], Note [Victims beyond the
// lookahead]): an acquire (a use now) may take any unit not held; a prefetch for the use at `use`
// is conservative (Cao et al., 1995): it displaces the unit that the rule takes when `use` comes,
// and only if that unit is neither held nor needed before then; otherwise it waits. So
// prefetching moves fetches earlier but never adds one. Among units ranked equal at `use` (used
// equally far after it, or all beyond the horizon), those idle until `use` were released before
// the others will have been by then, so the rule at `use` takes one of them: a tie with a unit
// that is held or needed first does not stop the prefetch.
// Note [Prefetch victims]
// ~~~~~~~~~~~~~~~~~~~~~~~
// An acquire takes the room Belady's rule gives among the units not held. A prefetch is
// conservative: it moves a fetch earlier but never adds one, so it displaces a unit only where
// the acquire it anticipates would displace the same one. For a use in a later step, the units
// held now are released before that use, and one of them may be the better victim then: they
// stay candidates, and when Belady picks one the prefetch waits for its release. For a later use
// in the step in progress (the next layer of a streamed trunk), the units held now (the step's
// task units) stay held past that use, as its acquire would find them: they are not candidates,
// or a unit held to the step's end, never used again, would stop every prefetch within the step.
// The unit coming in is never a candidate: make_room counts its own slot as freed, and the
// swap-in gives it up. Where its parameters alone are here for a use before the one prefetched
// (the last layer of a trunk, whose backward follows its forward), Belady would rank it the best
// victim, needed first, and the prefetch would wait for the forward's release: the backward at
// the trunk's turn would then wait for its whole slot's copy.
unit_record* swap_engine::pick_victim(const unit_record& coming, std::uint64_t use, room_for why)
{
  const bool for_acquire = why == room_for::acquire;
  const std::size_t use_step = for_acquire ? 0 : p_.plan.step_distance(use);
  victim_candidates_.clear();
  for (const std::uint32_t i : resident_) {
    if (i == coming.index) { continue; }  // its own slot is counted as freed (make_room), and goes at the swap-in
    const unit_record& r = p_.units[i];
    if (why != room_for::prefetch_later && r.held()) { continue; }
    const std::uint64_t next = for_acquire ? p_.plan.next_use(unit_id{i}) : p_.plan.next_use_after(unit_id{i}, use);
    const bool idle = for_acquire || (!r.held() && p_.plan.next_use(unit_id{i}) >= use);
    const std::size_t next_step = next == never ? no_next_step : p_.plan.step_distance(next);
    victim_candidates_.push_back({.unit = i,
                                  .next_use = next,
                                  .last_release = r.last_release,
                                  .idle = idle,
                                  .beyond = p_.model.beyond_horizon(use_step, next_step)});
  }
  const std::size_t k = residency_model::choose_victim(victim_candidates_);
  return k == victim_candidates_.size() ? nullptr : &p_.units[victim_candidates_[k].unit];
}

// A unit held for a frozen use in its whole slot gives up everything but its parameters: the plan
// check counted only those. What changed is written home first; the freed tail is reused only
// after that copy and the unit's previous uses of it.
void swap_engine::narrow_to_params(unit_record& r)
{
  if (r.dirty()) {
    write_back(r);
    h2d_waits_.push_back({r.index, &*r.written_back});
  }
  if (r.released.recorded()) { h2d_waits_.push_back({r.index, &r.released}); }
  if (r.host_stepped()) { h2d_waits_.push_back({r.index, &*r.grads_copied}); }
  const std::size_t keep = r.layout.params_bytes;
  r.held_bytes = p_.model.taken(keep);
  r.slot = p_.pool.shrink(r.pool_slot, keep);
  go(r, slot_move::narrow_to_params);
  note_device_bytes();
}

// The slot moves to other extents only after its previous users are done: the pool's fence waits
// for their events still in flight (the unit left the device at least one swap earlier, so there
// are rarely any), on the mapping thread, bounded by [runtime] timeout. A whole slot's extents part
// after the parameters, so that a frozen use can narrow it (narrow_to_params).
device_pool::mapping swap_engine::map_slot(unit_record& r, std::size_t bytes, std::size_t keep)
{
  // The units whose earlier uses of the addresses must be done: r itself, or for a packed unit
  // the units that had places in the class granule that moves.
  return p_.pool.map(r.pool_slot, bytes, keep, [&](device_pool::slot_id slot, stream_view fence) {
    std::string users;
    if (slot >= unit_of_slot_.size() || unit_of_slot_[slot] >= p_.units.size()) { return users; }  // staging
    const unit_record& u = p_.units[unit_of_slot_[slot]];
    const auto after = [&](const event& e) {
      if (!e.recorded() || e.query()) { return; }
      e.wait(fence);
      users = "'" + u.name + "'";
    };
    after(u.arrived);
    after(u.released);
    for (const std::optional<event>* e : {&u.written_back, &u.grads_copied, &u.grads_ready_event, &u.grads_done}) {
      if (*e) { after(**e); }
    }
    return users;
  });
}

bool swap_engine::make_room(const unit_record& r, std::size_t bytes, std::uint64_t use, room_for why)
{
  const auto fits = [&] {
    if (r.packed) { return r.resident() || p_.pool.fits(r.pool_slot, bytes); }  // resident: its own place frees
    const std::size_t freed_later = r.resident() ? p_.model.taken(r.slot->size()) : 0;
    return p_.pool.free() + freed_later >= p_.model.taken(bytes);
  };
  while (true) {
    if (fits()) { return true; }
    if (unit_record* victim = pick_victim(r, use, why)) {
      evict(*victim);
      room_victims_.push_back(victim->index);
      continue;
    }
    if (why != room_for::acquire) { return false; }  // a prefetch never narrows what the trainer holds
    // A unit held frozen in its whole slot: a clean one first (nothing to write home), then the
    // lowest unit id (the order the planner replays).
    unit_record* wide = nullptr;
    for (const std::uint32_t i : resident_) {
      unit_record& h = p_.units[i];
      if (h.phase() != detail::step_phase::frozen || h.params_only() || h.packed) {
        continue;
      }  // a place cannot narrow
      if (wide == nullptr || std::pair(h.dirty(), h.index) < std::pair(wide->dirty(), wide->index)) { wide = &h; }
    }
    if (wide == nullptr) { return false; }
    narrow_to_params(*wide);
  }
}

bool swap_engine::swap_in(unit_record& r, std::uint64_t use, room_for why, bool whole, bool fill)
{
  // Its parameters alone are here and it must come in whole: for an acquire, that copy goes first
  // (its room may be what the whole unit needs); a prefetch keeps it until the room is found.
  if (why == room_for::acquire && r.resident()) { evict(r); }
  const std::size_t bytes = whole ? r.layout.device_bytes : r.layout.params_bytes;
  // Its home is read below: the victims' write-backs that make its room keep its block cached.
  incoming_scope reading(r);
  room_victims_.clear();
  if (!make_room(r, bytes, use, why)) { return false; }  // counting what r gives up below
  if (r.resident()) { evict(r); }
  const device_pool::mapping m = map_slot(r, bytes, whole ? r.layout.params_bytes : 0);
  r.slot = m.range;
  go(r, whole ? detail::slot_move::swap_in_whole : fill ? detail::slot_move::swap_in_params : slot_move::map_params);
  add_resident(r);
  // Its copy follows that write-back part by part; a slot not filled (a stash ahead) waits for it whole.
  const std::uint32_t from = fill ? handoff_from(r) : no_handoff;
  const bool now = pending_fills_.empty() && p_.pool.ready(m.ready);
  order_fill(r, from, now ? p_.h2d : p_.fill_order);  // Note [Swap-ins waiting for a mapping]
  go(r, coherence_move::fill);
  r.unwritten = !fill;
  if (fill) { p_.ledger.swap_in(r.index, r.params_only() ? r.layout.params_bytes : r.layout.travel_bytes); }
  if (now) {
    enqueue_fill(r, from);
  } else {
    ensure(r.fill_ordered, p_.dev).record(p_.fill_order);
    pending_fills_.push_back({r.index, m.ready, from});
    reading.keep();  // the host cache keeps its home block until the copy is queued
  }
  note_device_bytes();
  return true;
}

bool swap_engine::swap_in_grads(unit_record& r, std::uint64_t use, stream_view user)
{
  const std::size_t bytes = r.layout.device_grad_bytes();
  // Its update steps its home, read ahead already: the victims' write-backs keep that block too.
  const incoming_scope reading(r);
  if (!make_room(r, bytes, use, room_for::acquire)) { return false; }
  const device_pool::mapping m = map_slot(r, bytes, 0);
  p_.pool.wait(m.ready);  // the update runs now
  r.slot = m.range;
  go(r, slot_move::map_grads);
  add_resident(r);
  flush_h2d_waits();  // the pool memory's previous users are done with it
  fill_async(*r.slot, std::byte{0}, p_.h2d);
  r.arrived.record(p_.h2d);
  r.arrived.wait(user);
  note_device_bytes();
  return true;
}

// Brings in the upcoming units in the order of their use, as far as each one's lookahead and the
// budget allow; stops at the first that does not fit, so no later unit takes its room.
void swap_engine::prefetch()
{
  p_.pool.check();
  issue_ready_fills();
  // The longest lookahead of a prefetched unit: the residency model's horizon (none: this step).
  const std::size_t ahead = p_.model.horizon() == no_next_step ? 0 : p_.model.horizon();
  stashed_ahead_.clear();
  p_.plan.for_each_upcoming(ahead, [&](unit_id u, planned_acquisition a, std::size_t distance) {
    unit_record& r = p_.units[u.value];
    const bool whole = a.whole();
    // An activation block's stash: its slot is mapped ahead, not filled; the reads after it want
    // what it writes, not what is home now. A slot mapped for a stash not made is no read's copy.
    const bool stash = a.use == planned_use::stash;
    if (stash) {
      stashed_ahead_.push_back(u.value);
    } else if (r.layout.activation &&
               std::find(stashed_ahead_.begin(), stashed_ahead_.end(), u.value) != stashed_ahead_.end()) {
      return true;
    }
    if (stash ? r.resident() : r.resident_for(whole) && !r.unwritten) { return true; }
    if (r.policy.residency != residency::prefetch) { return true; }
    if (distance > static_cast<std::size_t>(r.policy.lookahead)) { return true; }
    if (r.held()) { return false; }  // its parameters are in use: it comes in whole at its acquire, first
    if (!r.home_ready()) { return false; }  // a disk home still being read: the next prefetch comes back to it
    return swap_in(r, a.position, distance == 0 ? room_for::prefetch_this_step : room_for::prefetch_later, whole,
                   !stash);
  });
}

}  // namespace taskswap::detail
