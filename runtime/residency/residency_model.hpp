// SPDX-License-Identifier: Apache-2.0
#pragma once

// The residency model: the rules of what is on the device, in one device-free place.
//
// Note [One residency model]: the runtime's swap engine and the planner (`taskswap plan`) both
// call this, so what the planner predicts is what the runtime does, and a rule changes in one
// edit. It holds:
// - the budget's arithmetic: whole granules, the pinned units packed (256-byte aligned) into one
//   region, a packed unit (at most half a granule) charged a granule, the guard's share first;
// - the checks at registration (the pinned units fit; every other unit fits beside them) and of
//   a planned step (the units held at once, at every point of the step, fit beside the pinned);
// - Belady's rule for the victim of an eviction within the prefetch horizon, least recently
//   released beyond it (choose_victim, Note [Victims beyond the lookahead]);
// - the disk homes a step keeps in the host cache at once (count_homes_in_use).
// It knows units by their sizes and policies only: no device, no events, no home copies.

#include <taskswap/runtime.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace taskswap::detail {

/// `bytes` in whole granules of `granule`: what a range of them takes of the budget.
[[nodiscard]] constexpr std::size_t whole_granules(std::size_t bytes, std::size_t granule) noexcept
{
  return (bytes + granule - 1) / granule * granule;
}

/// The packing rule: a slot of at most half a granule (256-byte aligned) takes a place in a
/// granule shared by its size class (runtime/pool/device_pool.hpp).
[[nodiscard]] constexpr bool packs(std::size_t bytes, std::size_t granule) noexcept
{
  return (bytes + 255) / 256 * 256 * 2 <= granule;
}

/// The disk homes a step keeps in the host cache at once (Note [Host cache]; the runtime's plan
/// check and the planner both count it here). A home that `stays` (a unit trained with its AdamW
/// on the host: its gradients come home and the CPU steps the block) is in use from its acquire
/// to its release, or to the step's end where releases wait for it (`to_the_end`: a guard, a
/// communicator); any other home only while it is read, so the largest of those counts once.
/// `block(u)` is unit u's block in the cache, 0 for a unit whose home is not on disk.
struct homes_in_use {
  std::size_t bytes = 0;  ///< the most at once
  std::size_t staying = 0;  ///< units whose home stays in use
};
template <class Block, class Stays>
[[nodiscard]] homes_in_use count_homes_in_use(const step_plan& step, Block&& block, Stays&& stays, bool to_the_end)
{
  std::vector<std::uint32_t> staying;
  std::vector<std::uint32_t> now;
  const auto has = [](const std::vector<std::uint32_t>& v, std::uint32_t u) {
    return std::find(v.begin(), v.end(), u) != v.end();
  };
  for (const step_plan::entry& e : step.entries()) {
    if (e.acquire && block(e.unit.value) != 0 && stays(e) && !has(staying, e.unit.value)) {
      staying.push_back(e.unit.value);
    }
  }
  std::size_t held = 0;
  std::size_t peak = 0;
  std::size_t other = 0;
  for (const step_plan::entry& e : step.entries()) {
    const std::uint32_t u = e.unit.value;
    const std::size_t bytes = block(u);
    if (bytes == 0) { continue; }
    if (!has(staying, u)) {
      if (e.acquire) { other = std::max(other, bytes); }
    } else if (e.acquire && !has(now, u)) {
      now.push_back(u);
      held += bytes;
      peak = std::max(peak, held);
    } else if (!e.acquire && !to_the_end && has(now, u)) {
      now.erase(std::find(now.begin(), now.end(), u));
      held -= bytes;
    }
  }
  return {.bytes = peak + other, .staying = staying.size()};
}

/// What the model knows of a unit.
struct modelled_unit {
  std::string name;
  std::size_t device_bytes = 0;  // its whole slot
  std::size_t params_bytes = 0;  // its parameter slab: what a frozen use holds
  std::size_t reduce_bytes = 0;  // what its reduction moves: the bytes the reducer packs into buckets
  bool pinned = false;
  bool host_placement = false;  // for the hint of a message
  bool never_trained = false;  // unit_spec::trainable false: every use frozen
  bool activation = false;  // unit_spec::activation: stash uses, then frozen ones
  int lookahead = -1;  // a prefetched unit's lookahead in steps; -1 for a unit not prefetched
};

/// The most a step holds at once: as charged (whole granules, pinned units excluded), and its
/// units' slabs before rounding (the planner's rounding figure).
struct step_peak {
  std::size_t held = 0;
  std::size_t raw = 0;
};

/// How a step counts a unit released before the step's end.
struct step_rules {
  /// With a communicator: a whole use's room waits for its bucket's reduction to be launched,
  /// at the entry `reduction_points` gives for its release (to the step's end without them).
  bool wait_for_reduction = false;
  bool trained_count_to_end = false;  // guarded (scaler, clip): a trained unit's update waits for end_step
  std::span<const std::size_t> reduction_points = {};
};

/// With a communicator: the entry of `step` at which each release's room comes back, by entry
/// index (no_point: the step's end; other entries: unused). A unit reduced in the step keeps its
/// room until its bucket's reduction is launched, which the runtime does at the release that
/// makes that bucket and every bucket before it ready: the reduced units in reduction order are
/// `order`, unit order[i]'s bucket ending before order[reach[i]] at the latest (pack_buckets,
/// or bucket_reach before the ranks agree). A unit is ready at its last release in `step`, at
/// the step's start when it is in `ready_at_start` (units only other ranks train), or at the
/// step's end when `step` never releases it.
inline constexpr std::size_t no_point = static_cast<std::size_t>(-1);
[[nodiscard]] std::vector<std::size_t> reduction_points(const step_plan& step, std::span<const std::uint32_t> order,
                                                        std::span<const std::size_t> reach,
                                                        std::span<const std::uint32_t> ready_at_start = {});

/// A resident unit that an eviction could take, as choose_victim sees it.
struct victim_candidate {
  std::uint32_t unit = 0;
  std::uint64_t next_use = 0;  // when it is used next (positions or steps; larger is later)
  std::uint64_t last_release = 0;  // when it was last let go (larger is more recent)
  bool idle = true;  // not held and not needed before the use the room is for
  bool beyond = false;  // its next use lies past the horizon (residency_model::beyond_horizon)
};

/// A next use that the plan does not hold.
inline constexpr std::size_t no_next_step = static_cast<std::size_t>(-1);

class residency_model {
 public:
  /// The model of `units` in a budget of `budget` bytes mapped in granules of `granule`, of which
  /// `guard_bytes` (loss scaling, clipping; 0: none) are taken first, in whole granules.
  /// @throws config_error when the guard leaves nothing, the pinned units do not fit, or a unit
  /// can never fit beside them, with the numbers and what to change
  residency_model(std::size_t budget, std::size_t granule, std::size_t guard_bytes, std::vector<modelled_unit> units);

  [[nodiscard]] std::size_t granule() const noexcept { return granule_; }
  /// The bytes a range of `bytes` takes of the budget: whole granules.
  [[nodiscard]] std::size_t taken(std::size_t bytes) const noexcept { return whole_granules(bytes, granule_); }
  /// The guard's share of the budget (whole granules), 0 without a guard.
  [[nodiscard]] std::size_t guard_bytes() const noexcept { return guard_; }
  /// The whole granules of the budget the units may take (after the guard's).
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// What the pinned units take: packed, then in whole granules.
  [[nodiscard]] std::size_t pinned_bytes() const noexcept { return pinned_; }
  /// The pinned units' slabs packed (256-byte aligned), before granule rounding.
  [[nodiscard]] std::size_t pinned_packed_bytes() const noexcept { return pinned_packed_; }
  /// Whether unit `u` (not pinned) is packed.
  [[nodiscard]] bool packed(std::uint32_t u) const noexcept { return packed_[u]; }
  /// What unit `u` holding `bytes` is charged of the budget: whole granules, or for a packed unit
  /// one granule, the most its place can cost whichever other places are taken.
  [[nodiscard]] std::size_t charged(std::uint32_t u, std::size_t bytes) const noexcept
  {
    return packed_[u] ? granule_ : taken(bytes);
  }
  /// What a use of unit `u` is charged: its whole slot, or (a frozen use) its parameters alone.
  [[nodiscard]] std::size_t use_charge(std::uint32_t u, bool whole) const noexcept
  {
    const modelled_unit& m = units_[u];
    return charged(u, whole ? m.device_bytes : m.params_bytes);
  }
  /// " (in whole granules of 2.0 MiB)" where the granule rounds more than the slab alignment does.
  [[nodiscard]] std::string granule_note() const;

  /// Checks one planned step: at every point, the units held at once fit beside the pinned ones.
  /// `whole_frozen`: units the step uses frozen that take their whole slot all the same (with a
  /// communicator, units other ranks train in the step). Returns the most the step holds at once,
  /// pinned units excluded.
  /// @throws config_error naming the step, the units held and the bytes, or a release of a unit
  /// not held, an acquire of a unit held, a trained use of a unit never trained, a re-acquire of a
  /// trained unit in a guarded step
  step_peak check_step(const step_plan& step, std::uint64_t step_number, const step_rules& rules,
                       std::span<const std::uint32_t> whole_frozen = {}) const;

  /// With a communicator, before the ranks agree (and in the planner): reduction_points from the
  /// units `step` trains, the others unknown, each unit's bucket ending where bucket_reach says.
  [[nodiscard]] std::vector<std::size_t> local_reduction_points(const step_plan& step, std::size_t bucket_cap) const;

  /// The steps past a use within which eviction ranks units by their next use: the longest
  /// lookahead of a prefetched unit, or every step when no unit is prefetched.
  [[nodiscard]] std::size_t horizon() const noexcept { return horizon_; }
  /// Whether a unit next used in step `next_step` (no_next_step: not in the plan) lies beyond the
  /// horizon past a use in step `use_step` (steps counted from any one origin).
  [[nodiscard]] bool beyond_horizon(std::size_t use_step, std::size_t next_step) const noexcept
  {
    return next_step == no_next_step || (horizon_ != no_next_step && next_step - use_step > horizon_);
  }

  /// The victim (Note [Victims beyond the lookahead]): a candidate beyond the horizon before one
  /// within it; within it, Belady's rule, the one used furthest in the future; then an idle one
  /// before one that is not, then the least recently released. Returns the chosen candidate's
  /// index, or `candidates.size()` when there is none or the choice is not idle (a prefetch then
  /// waits: it moves fetches earlier but never adds one; docs/runtime.md, "conservative").
  [[nodiscard]] static std::size_t choose_victim(std::span<const victim_candidate> candidates) noexcept;

 private:
  std::size_t granule_;
  std::size_t guard_ = 0;
  std::size_t capacity_ = 0;
  std::size_t pinned_packed_ = 0;
  std::size_t pinned_ = 0;
  std::size_t horizon_ = no_next_step;
  std::vector<modelled_unit> units_;
  std::vector<bool> packed_;
};

}  // namespace taskswap::detail
