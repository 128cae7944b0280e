// SPDX-License-Identifier: Apache-2.0
#pragma once

// Note [Unit states]
// ~~~~~~~~~~~~~~~~~~
// A registered unit is in one state of each of three machines, each with named transitions:
//
//   slot_content  what its device slot holds: none, whole, params (a frozen use), grads (a
//                 gradient slab alone, for a host update other ranks trained);
//   coherence     its device copy against home: clean, device_newer (a device update not
//                 written back), home_newer (a host update not uploaded), refreshed (uploaded,
//                 while the gradients' copy home may still read the slot);
//   step_phase    the current acquisition and its update within the step.
//
// Which phases a unit can reach depends on the runtime's step path, fixed at construction: with
// or without a communicator, guarded (loss scaling or clipping) or not. The tables below are the
// legal moves; docs/runtime.md ("Unit states") lists them, and tests/runtime/unit_state_test.cpp
// walks every (phase, move, path). A unit_record holds its three states and nothing else about
// them: the runtime changes them only by named moves (unit_record::go), and a move the tables do
// not have from the unit's state on the runtime's path throws an internal error, in every build
// (the tables are compiled into lookups: a move costs one load). With TASKSWAP_CHECK_STATES=1 (set
// for the tests) each public step call (acquire, grads_ready, step, release, skip, end_step,
// flush, plan) also checks that every unit's states are consistent across the three machines
// (inconsistency()), and that the unit it names reached its phase by the moves that call may make
// (acquire_moves, step_moves, release_moves(path), skip_moves(path); none for grads_ready).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace taskswap::detail {

enum class slot_content : std::uint8_t { none, whole, params, grads };
inline constexpr std::size_t slot_content_count = 4;
enum class coherence : std::uint8_t { clean, device_newer, home_newer, refreshed };
inline constexpr std::size_t coherence_count = 4;
enum class step_phase : std::uint8_t {
  idle,  // not held (and not updated this step)
  train,  // held by the trainer for a trained use, not stepped
  frozen,  // held for a forward-only use no rank trains
  frozen_reduced,  // held frozen here while other ranks train it: takes their update at release
  stepped_local,  // stepped on the trainer's stream (no communicator, unguarded)
  stepped_reduced,  // stepped on the trainer's stream after its reduction (communicator)
  step_deferred,  // stepped; the update waits for the reduction's launch or for end_step
  updated_on_aux,  // the deferred update ran on aux; the trainer still holds it
  release_deferred,  // the trainer released it before its update ran; the runtime holds it
  update_only,  // held by the runtime to apply an update other ranks trained
  updated,  // updated and released in this step (communicator); idle again at end_step
};
inline constexpr std::size_t phase_count = 11;

/// The runtime's step path: its variants of the step protocol.
enum class step_path : std::uint8_t { local, local_guarded, reduced, reduced_guarded };
inline constexpr std::size_t path_count = 4;

[[nodiscard]] constexpr step_path path_of(bool communicator, bool guarded) noexcept
{
  return communicator ? (guarded ? step_path::reduced_guarded : step_path::reduced)
                      : (guarded ? step_path::local_guarded : step_path::local);
}

enum class phase_move : std::uint8_t {
  acquire_train,
  acquire_frozen,
  acquire_frozen_reduced,
  hold_for_update,
  step_local,
  step_now,
  defer_to_reduction,
  defer_to_end_step,
  update_on_aux,
  defer_release,
  release,
  release_after_update,
  update_and_release,
  end_step_reset,
};
inline constexpr std::size_t phase_move_count = 14;

enum class slot_move : std::uint8_t {
  place_pinned,
  swap_in_whole,
  swap_in_params,
  map_grads,
  narrow_to_params,
  evict,
  map_params,  // an activation block's slot for a stash: mapped, not filled
};
inline constexpr std::size_t slot_move_count = 7;
enum class coherence_move : std::uint8_t { fill, step_on_device, step_on_host, write_back, upload_params, drop, stash };
inline constexpr std::size_t coherence_move_count = 7;

[[nodiscard]] std::string_view to_string(slot_content c) noexcept;
[[nodiscard]] std::string_view to_string(coherence c) noexcept;
[[nodiscard]] std::string_view to_string(step_phase p) noexcept;
[[nodiscard]] std::string_view to_string(step_path p) noexcept;
[[nodiscard]] std::string_view to_string(phase_move m) noexcept;
[[nodiscard]] std::string_view to_string(slot_move m) noexcept;
[[nodiscard]] std::string_view to_string(coherence_move m) noexcept;

template <class E>
[[nodiscard]] constexpr std::uint32_t bit(E e) noexcept
{
  return std::uint32_t{1} << static_cast<unsigned>(e);
}
template <class E, class... More>
[[nodiscard]] constexpr std::uint32_t bits(E e, More... more) noexcept
{
  return (bit(e) | ... | bit(more));
}

/// One legal move: on the paths in `paths` (bits of step_path), from any state in `from` (bits)
/// to `to`.
template <class Move, class State>
struct transition_row {
  Move move;
  std::uint32_t paths;
  std::uint32_t from;
  State to;
};

inline constexpr std::uint32_t all_paths = 0xF;
inline constexpr std::uint32_t local_paths = bits(step_path::local, step_path::local_guarded);
inline constexpr std::uint32_t reduced_paths = bits(step_path::reduced, step_path::reduced_guarded);

using phase_row = transition_row<phase_move, step_phase>;
using slot_row = transition_row<slot_move, slot_content>;
using coherence_row = transition_row<coherence_move, coherence>;

namespace unit_tables {
using sp = step_phase;
using pm = phase_move;
using path = step_path;
using sc = slot_content;
using ch = coherence;

// The step protocol's moves (Note [Unit states]); a (move, path) pair selects at most one row.
inline constexpr std::array phase_rows{
  phase_row{pm::acquire_train, all_paths, bits(sp::idle), sp::train},
  phase_row{pm::acquire_frozen, all_paths, bits(sp::idle), sp::frozen},
  phase_row{pm::acquire_frozen_reduced, reduced_paths, bits(sp::idle), sp::frozen_reduced},
  phase_row{pm::hold_for_update, reduced_paths, bits(sp::idle), sp::update_only},
  phase_row{pm::step_local, bits(path::local), bits(sp::train, sp::stepped_local), sp::stepped_local},
  phase_row{pm::step_now, bits(path::reduced), bits(sp::train, sp::frozen_reduced), sp::stepped_reduced},
  phase_row{pm::defer_to_reduction, bits(path::reduced), bits(sp::train, sp::frozen_reduced), sp::step_deferred},
  phase_row{pm::defer_to_end_step, bits(path::local_guarded), bits(sp::train), sp::step_deferred},
  phase_row{pm::defer_to_end_step, bits(path::reduced_guarded), bits(sp::train, sp::frozen_reduced), sp::step_deferred},
  phase_row{pm::update_on_aux, bits(path::reduced), bits(sp::step_deferred), sp::updated_on_aux},
  phase_row{pm::defer_release, bits(path::local_guarded, path::reduced, path::reduced_guarded), bits(sp::step_deferred),
            sp::release_deferred},
  phase_row{pm::release, bits(path::local), bits(sp::train, sp::stepped_local, sp::frozen), sp::idle},
  phase_row{pm::release, bits(path::local_guarded), bits(sp::train, sp::frozen), sp::idle},
  phase_row{pm::release, reduced_paths, bits(sp::frozen), sp::idle},
  phase_row{pm::release_after_update, bits(path::reduced), bits(sp::stepped_reduced, sp::updated_on_aux), sp::updated},
  phase_row{pm::update_and_release, reduced_paths, bits(sp::release_deferred, sp::update_only), sp::updated},
  phase_row{pm::update_and_release, bits(path::local_guarded), bits(sp::release_deferred), sp::idle},
  phase_row{pm::end_step_reset, reduced_paths, bits(sp::idle, sp::updated), sp::idle},
};

// What the device slot holds (path-free).
inline constexpr std::array slot_rows{
  slot_row{slot_move::place_pinned, all_paths, bits(sc::none), sc::whole},
  slot_row{slot_move::swap_in_whole, all_paths, bits(sc::none), sc::whole},
  slot_row{slot_move::swap_in_params, all_paths, bits(sc::none), sc::params},
  slot_row{slot_move::map_grads, reduced_paths, bits(sc::none), sc::grads},
  slot_row{slot_move::narrow_to_params, all_paths, bits(sc::whole), sc::params},
  slot_row{slot_move::evict, all_paths, bits(sc::whole, sc::params, sc::grads), sc::none},
  slot_row{slot_move::map_params, all_paths, bits(sc::none), sc::params},
};

// The device copy against home (path-free); a device_newer copy is written back before a drop.
inline constexpr std::array coherence_rows{
  coherence_row{coherence_move::fill, all_paths, bits(ch::clean), ch::clean},
  coherence_row{coherence_move::step_on_device, all_paths, bits(ch::clean, ch::device_newer), ch::device_newer},
  coherence_row{coherence_move::step_on_host, all_paths, bits(ch::clean, ch::refreshed, ch::home_newer),
                ch::home_newer},
  coherence_row{coherence_move::write_back, all_paths, bits(ch::device_newer), ch::clean},
  coherence_row{coherence_move::upload_params, all_paths, bits(ch::home_newer), ch::refreshed},
  coherence_row{coherence_move::drop, all_paths, bits(ch::clean, ch::refreshed, ch::home_newer), ch::clean},
  coherence_row{coherence_move::stash, all_paths, bits(ch::clean), ch::device_newer},
};
}  // namespace unit_tables
using unit_tables::coherence_rows;
using unit_tables::phase_rows;
using unit_tables::slot_rows;

/// The state `move` leads to from `from` on path `p`, or nothing where the tables have no such move.
template <class Move, class State, std::size_t N>
[[nodiscard]] constexpr std::optional<State> next(const std::array<transition_row<Move, State>, N>& rows, State from,
                                                  Move move, step_path p) noexcept
{
  for (const auto& row : rows) {
    if (row.move == move && (row.paths & bit(p)) != 0 && (row.from & bit(from)) != 0) { return row.to; }
  }
  return std::nullopt;
}

/// A table as a lookup: the state each (path, move, from) leads to, or nothing; what the runtime's
/// moves consult (equal to next() over the rows, which unit_state_test checks for every triple).
template <class Move, class State, std::size_t Moves, std::size_t States>
class move_lookup {
 public:
  template <std::size_t N>
  constexpr explicit move_lookup(const std::array<transition_row<Move, State>, N>& rows) noexcept
  {
    to_.fill(none);
    for (const auto& row : rows) {
      for (std::size_t p = 0; p < path_count; ++p) {
        for (std::size_t from = 0; from < States; ++from) {
          if ((row.paths & (std::uint32_t{1} << p)) != 0 && (row.from & (std::uint32_t{1} << from)) != 0) {
            to_[index(static_cast<step_path>(p), row.move, static_cast<State>(from))] =
              static_cast<std::uint8_t>(row.to);
          }
        }
      }
    }
  }
  [[nodiscard]] constexpr std::optional<State> operator()(State from, Move move, step_path p) const noexcept
  {
    const std::uint8_t to = to_[index(p, move, from)];
    return to == none ? std::nullopt : std::optional<State>(static_cast<State>(to));
  }

 private:
  static constexpr std::uint8_t none = 0xFF;
  [[nodiscard]] static constexpr std::size_t index(step_path p, Move move, State from) noexcept
  {
    return (static_cast<std::size_t>(p) * Moves + static_cast<std::size_t>(move)) * States +
           static_cast<std::size_t>(from);
  }
  std::array<std::uint8_t, path_count * Moves * States> to_{};
};

inline constexpr move_lookup<phase_move, step_phase, phase_move_count, phase_count> phase_after{phase_rows};
inline constexpr move_lookup<slot_move, slot_content, slot_move_count, slot_content_count> slot_after{slot_rows};
inline constexpr move_lookup<coherence_move, coherence, coherence_move_count, coherence_count> coherence_after{
  coherence_rows};

/// A move the tables do not have: the runtime's internal error, naming the unit, the move, the
/// state and the path.
[[noreturn]] void illegal_move(std::string_view unit, std::string_view move, std::string_view from, step_path p);

inline constexpr std::uint32_t all_phase_moves = (std::uint32_t{1} << phase_move_count) - 1;

/// The phases reachable from `from` on path `p` by one or more of the moves in `moves` (bits of
/// phase_move): `from` itself only where those moves lead back to it.
[[nodiscard]] constexpr std::uint32_t reachable_phases(step_phase from, step_path p,
                                                       std::uint32_t moves = all_phase_moves) noexcept
{
  std::uint32_t seen = 0;
  std::uint32_t frontier = bit(from);
  for (bool grew = true; grew;) {
    grew = false;
    for (const phase_row& row : phase_rows) {
      if ((row.paths & bit(p)) != 0 && (moves & bit(row.move)) != 0 && (row.from & (frontier | seen)) != 0 &&
          (seen & bit(row.to)) == 0) {
        seen |= bit(row.to);
        grew = true;
      }
    }
  }
  return seen;
}

/// The moves each of the runtime's public step calls may make of the unit it names.
inline constexpr std::uint32_t acquire_moves =
  bits(phase_move::acquire_train, phase_move::acquire_frozen, phase_move::acquire_frozen_reduced);
inline constexpr std::uint32_t step_moves =
  bits(phase_move::step_local, phase_move::step_now, phase_move::defer_to_reduction, phase_move::update_on_aux,
       phase_move::defer_to_end_step);
/// A skip: none without a communicator (it only drops planned uses); with one, a use to reduce is
/// completed as end_step would (held for the update, then, unguarded, updated and released once
/// its bucket is launched; guarded, the update waits for end_step).
[[nodiscard]] constexpr std::uint32_t skip_moves(step_path p) noexcept
{
  switch (p) {
    case step_path::local:
    case step_path::local_guarded: return 0;
    case step_path::reduced: return bits(phase_move::hold_for_update, phase_move::update_and_release);
    case step_path::reduced_guarded: return bits(phase_move::hold_for_update);
  }
  return 0;
}
/// A release: with a communicator an unstepped trained (or frozen_reduced) unit is stepped first.
[[nodiscard]] constexpr std::uint32_t release_moves(step_path p) noexcept
{
  switch (p) {
    case step_path::local: return bits(phase_move::release);
    case step_path::local_guarded: return bits(phase_move::release, phase_move::defer_release);
    case step_path::reduced:
      return bits(phase_move::step_now, phase_move::defer_to_reduction, phase_move::update_on_aux,
                  phase_move::defer_release, phase_move::release, phase_move::release_after_update);
    case step_path::reduced_guarded:
      return bits(phase_move::defer_to_end_step, phase_move::defer_release, phase_move::release);
  }
  return 0;
}

/// The phases each step path reaches from idle, by path.
inline constexpr std::array<std::uint32_t, path_count> path_phases{
  reachable_phases(step_phase::idle, step_path::local) | bit(step_phase::idle),
  reachable_phases(step_phase::idle, step_path::local_guarded) | bit(step_phase::idle),
  reachable_phases(step_phase::idle, step_path::reduced) | bit(step_phase::idle),
  reachable_phases(step_phase::idle, step_path::reduced_guarded) | bit(step_phase::idle)};

/// A unit's three states.
struct unit_states {
  slot_content content = slot_content::none;
  coherence coh = coherence::clean;
  step_phase phase = step_phase::idle;

  friend constexpr bool operator==(const unit_states&, const unit_states&) = default;

  /// Someone holds it: the trainer, or the runtime for an update.
  [[nodiscard]] constexpr bool held() const noexcept
  {
    return phase != step_phase::idle && phase != step_phase::updated;
  }
  [[nodiscard]] constexpr bool runtime_holds() const noexcept
  {
    return phase == step_phase::release_deferred || phase == step_phase::update_only;
  }
  [[nodiscard]] constexpr bool frozen_use() const noexcept
  {
    return phase == step_phase::frozen || phase == step_phase::frozen_reduced;
  }
};

/// What a unit's states must satisfy between the runtime's calls, for a unit whose optimizer is
/// on the host (`host_update`) or the device, pinned or not, an activation block or not, on path
/// `p`. Empty where they do;
/// else the rule they break.
[[nodiscard]] constexpr std::string_view inconsistency(const unit_states& s, bool host_update, bool pinned, step_path p,
                                                       bool activation = false) noexcept
{
  if ((path_phases[static_cast<std::size_t>(p)] & bit(s.phase)) == 0) { return "a phase its step path never reaches"; }
  if (s.content == slot_content::none && s.coh != coherence::clean) { return "no slot, yet not clean"; }
  // An activation block held for its stash: its parameter slab is written on the device.
  const bool stashing = activation && s.content == slot_content::params && s.phase == step_phase::frozen &&
                        s.coh == coherence::device_newer;
  if (s.coh == coherence::device_newer && (s.content != slot_content::whole || host_update) && !stashing) {
    return "device_newer without a whole slot updated on the device, or a stash";
  }
  if ((s.coh == coherence::home_newer || s.coh == coherence::refreshed) && !host_update) {
    return "home_newer or refreshed for a unit updated on the device";
  }
  if (s.content == slot_content::params && s.coh != coherence::clean && s.coh != coherence::refreshed && !stashing) {
    return "params alone, not clean";
  }
  if (s.content == slot_content::grads && (!host_update || pinned || s.phase != step_phase::update_only)) {
    return "a gradient slab alone outside a host update of another rank's training";
  }
  if (pinned && s.content != slot_content::whole) { return "a pinned unit without its whole slot"; }
  if (s.held() && s.content == slot_content::none) { return "held without a slot"; }
  if (s.frozen_use() && s.content == slot_content::grads) { return "a frozen use of a gradient slab"; }
  const bool needs_whole = s.phase == step_phase::train || s.phase == step_phase::stepped_local ||
                           s.phase == step_phase::stepped_reduced || s.phase == step_phase::step_deferred ||
                           s.phase == step_phase::updated_on_aux || s.phase == step_phase::release_deferred ||
                           s.phase == step_phase::frozen_reduced;
  if (needs_whole && s.content != slot_content::whole) { return "a trained use without its whole slot"; }
  return {};
}

}  // namespace taskswap::detail
