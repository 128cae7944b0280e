// SPDX-License-Identifier: Apache-2.0
#pragma once

// A registered unit as the runtime tracks it: its layout, home block and slot, its residency
// state, and the events that order its swaps, updates and releases across streams.

#include "runtime/homes/home_tier.hpp"
#include "runtime/units/unit_layout.hpp"
#include "runtime/units/unit_state.hpp"

#include <taskswap/device.hpp>
#include <taskswap/runtime.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace taskswap::detail {

struct unit_record {
  std::string name;
  unit_policy policy;
  unit_layout layout;
  unit_home home;  // its home copy, where its tier keeps it (Note [Home tiers])
  std::optional<device_span> slot;
  std::uint32_t pool_slot = 0;  // its slot in the device pool (not pinned)
  bool packed = false;  // its slot is a place in a granule shared by its size class
  // What its slot holds, its device copy against home, its step phase (Note [Unit states]):
  // changed only by go().
  unit_states st;
  std::size_t held_bytes = 0;  // what its acquisition takes of the budget (an error names the sum)
  std::int64_t step = 0;
  bool incoming = false;  // being swapped in: its home block is read now, so the host cache keeps it
  // An activation block's slot mapped for a stash and not yet written: its fill copies nothing,
  // and a read before the stash brings the home instead (the slot holds nothing of it).
  bool unwritten = false;
  bool home_written = false;  // home() was taken before start and since derive_params(): its params are derived
  std::uint64_t last_release = 0;
  std::size_t resident_index = 0;  // in swap_engine's resident set
  event arrived;
  event released;
  std::optional<event> grads_ready_event;
  std::optional<event> written_back;
  // Its swap-in's place among the waits for pool memory, where its copy waits for its mapping
  // (Note [Swap-ins waiting for a mapping]).
  std::optional<event> fill_ordered;
  // Its last write-back in parts (Note [Handoff]): an event after each part, in order, each part
  // `written_part_bytes` but the last; none where it went whole.
  std::vector<event> written_parts;
  std::size_t written_part_count = 0;
  std::size_t written_part_bytes = 0;
  std::optional<event> grads_done;
  std::optional<event> grads_copied;
  std::optional<event> host_updated;
  std::size_t trace_span = 0;
  std::uint32_t index = 0;  // its unit_id
  void* released_on = nullptr;  // the stream of its last release: a user on another one waits for it
  std::optional<event> step_point;  // the trainer's stream at step(), for an update that runs later
  std::optional<event> trainer_released;  // the trainer's stream at release(), for a release that runs later

  unit_record(const device& dev, std::uint32_t i, std::string n, unit_policy p, unit_layout l)
      : name(std::move(n)), policy(std::move(p)), layout(std::move(l)), arrived(dev), released(dev), index(i)
  {}
  [[nodiscard]] bool resident() const noexcept { return slot.has_value(); }
  /// Resident with what a use needs: the whole slot, or for a frozen use (`whole` false) at least
  /// the parameters.
  [[nodiscard]] bool resident_for(bool whole) const noexcept
  {
    return resident() && !(whole && st.content == slot_content::params);
  }
  /// Someone holds it: the trainer, or the runtime for an update.
  [[nodiscard]] bool held() const noexcept { return st.held(); }
  [[nodiscard]] step_phase phase() const noexcept { return st.phase; }
  /// Its device copy has an update not written home (device placement).
  [[nodiscard]] bool dirty() const noexcept { return st.coh == coherence::device_newer; }
  /// A host step read the gradients of this residency: its slot's reuse waits for that copy.
  [[nodiscard]] bool host_stepped() const noexcept
  {
    return st.coh == coherence::home_newer || st.coh == coherence::refreshed;
  }
  [[nodiscard]] bool params_only() const noexcept { return st.content == slot_content::params; }
  [[nodiscard]] bool grads_only() const noexcept { return st.content == slot_content::grads; }
  /// The moves (Note [Unit states]): each leads where its table says, or is an internal error.
  void go(phase_move m, step_path p) { st.phase = after(phase_after, st.phase, m, p); }
  void go(slot_move m, step_path p) { st.content = after(slot_after, st.content, m, p); }
  void go(coherence_move m, step_path p) { st.coh = after(coherence_after, st.coh, m, p); }
  [[nodiscard]] bool pinned() const noexcept { return policy.residency == residency::pinned; }
  /// Its home copy as host memory (for the CPU AdamW, checkpoints, replica checks, home()).
  [[nodiscard]] std::byte* home_block() const { return home.tier->host_block(home).data(); }
  /// Whether stage_in() would start at once (a disk home already read into the host cache).
  [[nodiscard]] bool home_ready() const { return home.tier->ready(home); }
  /// Work on `s` (nullptr: the host, done) used home_block(); `wrote`: it changed it. Said at once
  /// after taking home_block(), before another home is touched (Note [Home tiers]).
  void home_used(const stream_view* s, bool wrote) const { home.tier->used(home, s, wrote); }
  /// Enqueues on `s` the copy of home bytes [offset, offset + dst.size()) to `dst`.
  void stage_in(std::size_t offset, device_span dst, stream_view s) const { home.tier->stage_in(home, offset, dst, s); }
  /// Enqueues on `s` the copy of `src` into home bytes [offset, offset + src.size()).
  void write_home(std::size_t offset, const_device_span src, stream_view s) const
  {
    home.tier->write_back(home, offset, src, s);
  }
  /// Where the gradients start in its slot.
  [[nodiscard]] std::size_t grads_at() const noexcept { return grads_only() ? 0 : layout.device_grads; }

 private:
  template <class Lookup, class State, class Move>
  [[nodiscard]] State after(const Lookup& lookup, State from, Move m, step_path p) const
  {
    const std::optional<State> to = lookup(from, m, p);
    if (!to) { illegal_move(name, to_string(m), to_string(from), p); }
    return *to;
  }
};

inline unit_state state_of(const unit_record& r) noexcept
{
  return r.held() ? unit_state::held : r.resident() ? unit_state::resident : unit_state::home;
}

/// The event in `e`, made on first use.
inline event& ensure(std::optional<event>& e, const device& dev)
{
  if (!e) { e.emplace(dev); }
  return *e;
}

}  // namespace taskswap::detail
