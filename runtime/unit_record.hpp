// SPDX-License-Identifier: Apache-2.0
#pragma once

// A registered unit as the runtime tracks it: its layout, home block and slot, its residency
// state, and the events that order its swaps, updates and releases across streams.

#include "runtime/home_tier.hpp"
#include "runtime/unit_layout.hpp"
#include "runtime/unit_state.hpp"

#include <taskswap/device.hpp>
#include <taskswap/runtime.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace taskswap::detail {

struct unit_record {
  std::string name;
  unit_policy policy;
  unit_layout layout;
  unit_home home;  // its home copy, where its tier keeps it (Note [Home tiers])
  std::optional<device_span> slot;
  std::uint32_t pool_slot = 0;  // its slot in the device pool (not pinned)
  bool packed = false;  // its slot is a place in a granule shared by its size class
  bool held = false;
  bool dirty = false;  // the device copy is newer than home (device placement)
  bool params_stale = false;  // home is newer than the device copy (host placement, after a step)
  bool stepped_here = false;  // a host step read this residency's gradients
  bool stepped = false;  // step() since its acquire (without a communicator)
  bool params_only = false;  // its slot holds the parameters alone (brought in or narrowed for a frozen use)
  bool frozen = false;  // the current acquisition is a frozen use (forward only)
  bool frozen_reduced = false;  // ... while other ranks train it: whole, zero gradients, takes the update
  std::size_t held_bytes = 0;  // what its acquisition adds to runtime::impl::held_bytes_
  std::int64_t step = 0;
  std::uint64_t last_release = 0;
  std::size_t resident_index = 0;  // in runtime::impl::resident_
  std::size_t swap_ins = 0;
  std::size_t write_backs = 0;
  event arrived;
  event released;
  std::optional<event> grads_ready_event;
  std::optional<event> written_back;
  std::optional<event> grads_done;
  std::optional<event> grads_copied;
  std::optional<event> host_updated;
  std::size_t trace_span = 0;
  std::uint32_t index = 0;  // its unit_id
  // With a communicator, within the current step:
  bool update_only = false;  // acquired by the runtime to apply an update other ranks trained
  bool step_requested = false;  // step() was called (or the runtime stepped it)
  bool step_deferred = false;  // step() came before its reduction was launched; the update waits
  bool updated_on_aux = false;  // its update ran on the runtime's aux stream
  bool release_deferred = false;  // the trainer released it before the deferred update ran
  void* released_on = nullptr;  // the stream of its last release: a user on another one waits for it
  bool grads_only = false;  // its slot holds only a gradient slab (host placement, update only)
  std::optional<event> step_point;  // the trainer's stream at step()
  std::optional<event> trainer_released;  // the trainer's stream at release()

  unit_record(const device& dev, std::uint32_t i, std::string n, unit_policy p, unit_layout l)
      : name(std::move(n)), policy(std::move(p)), layout(std::move(l)), arrived(dev), released(dev), index(i)
  {}
  [[nodiscard]] bool resident() const noexcept { return slot.has_value(); }
  /// Resident with what a use needs: the whole slot, or for a frozen use (`whole` false) at least
  /// the parameters.
  [[nodiscard]] bool resident_for(bool whole) const noexcept { return resident() && !(whole && params_only); }
  [[nodiscard]] bool pinned() const noexcept { return policy.residency == residency::pinned; }
  /// Its home copy as host memory (for the CPU AdamW, checkpoints, replica checks, home()).
  [[nodiscard]] std::byte* home_block() const { return home.tier->host_block(home).data(); }
  /// Enqueues on `s` the copy of home bytes [offset, offset + dst.size()) to `dst`.
  void stage_in(std::size_t offset, device_span dst, stream_view s) const { home.tier->stage_in(home, offset, dst, s); }
  /// Enqueues on `s` the copy of `src` into home bytes [offset, offset + src.size()).
  void write_home(std::size_t offset, const_device_span src, stream_view s) const
  {
    home.tier->write_back(home, offset, src, s);
  }
  /// Where the gradients start in its slot.
  [[nodiscard]] std::size_t grads_at() const noexcept { return grads_only ? 0 : layout.device_grads; }
};

inline unit_state state_of(const unit_record& r) noexcept
{
  return r.held ? unit_state::held : r.resident() ? unit_state::resident : unit_state::home;
}

/// Its states (Note [Unit states]) read off its flags.
inline unit_states derive(const unit_record& r) noexcept
{
  unit_states s;
  if (r.slot) {
    s.content = r.params_only ? slot_content::params : r.grads_only ? slot_content::grads : slot_content::whole;
    s.coh = r.dirty          ? coherence::device_newer
            : r.params_stale ? coherence::home_newer
            : r.stepped_here ? coherence::refreshed
                             : coherence::clean;
  }
  if (!r.held) {
    s.phase = r.step_requested ? step_phase::updated : step_phase::idle;
  } else if (r.release_deferred) {
    s.phase = step_phase::release_deferred;
  } else if (r.update_only) {
    s.phase = step_phase::update_only;
  } else if (r.step_deferred) {
    s.phase = step_phase::step_deferred;
  } else if (r.updated_on_aux) {
    s.phase = step_phase::updated_on_aux;
  } else if (r.step_requested) {
    s.phase = step_phase::stepped_reduced;
  } else if (r.frozen) {
    s.phase = r.frozen_reduced ? step_phase::frozen_reduced : step_phase::frozen;
  } else if (r.stepped) {
    s.phase = step_phase::stepped_local;
  } else {
    s.phase = step_phase::train;
  }
  return s;
}

/// The event in `e`, made on first use.
inline event& ensure(std::optional<event>& e, const device& dev)
{
  if (!e) { e.emplace(dev); }
  return *e;
}

}  // namespace taskswap::detail
