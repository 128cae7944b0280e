// SPDX-License-Identifier: Apache-2.0
#pragma once

// The planner's replays (make_plan in planner.cpp): its view of each unit, the host cache's
// replay, and the runtime's residency over the planned steps, in order of the steps' uses or of
// the trainer's calls (plan_input::ordered).

#include "planner.hpp"

#include "runtime/residency/residency_model.hpp"
#include "storage/host_cache.hpp"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <map>
#include <utility>
#include <vector>

namespace taskswap::tools::replay {

inline constexpr std::size_t page = 4096;
inline constexpr std::size_t never = std::numeric_limits<std::size_t>::max();

struct traffic {
  double h2d = 0;
  double d2h = 0;
  double swap_ins = 0;
};

struct planned_unit {
  unit_policy policy;
  unit_footprint fp;
  std::vector<std::size_t> uses;  // steps that acquire it, ascending
  [[nodiscard]] bool pinned() const noexcept { return policy.residency == residency::pinned; }
  [[nodiscard]] bool host() const noexcept { return policy.optimizer == optimizer_placement::host; }
  bool cached = false;  // its home is read through the host cache (home_is_cached)
  bool activation = false;  // an activation block: written home at its stash's release, freed after its last read
  [[nodiscard]] bool disk() const noexcept { return cached; }
  /// How a device write-back touches its disk home: whole (no read first) or in part.
  [[nodiscard]] bool whole_write_back() const noexcept { return fp.write_back_bytes >= fp.home_bytes; }
  [[nodiscard]] std::size_t next_use_after(std::size_t step) const
  {
    const auto it = std::upper_bound(uses.begin(), uses.end(), step);
    return it == uses.end() ? never : *it;
  }
  /// Host AdamW after a trained use: the gradients go home, and the new parameters come back if
  /// the unit stays (pinned, or used again within its lookahead, `steps_to_next` steps on). Returns
  /// whether it stays resident.
  bool host_update(std::size_t steps_to_next, double counted, traffic& t) const
  {
    t.d2h += counted * static_cast<double>(fp.grad_bytes);
    if (pinned() || steps_to_next <= static_cast<std::size_t>(std::max(policy.lookahead, 0))) {
      t.h2d += counted * static_cast<double>(fp.param_bytes);
      return true;
    }
    return false;
  }
};

// The host cache in front of the disk homes (storage/host_cache.hpp, Note [Host cache]),
// replayed at the runtime's touches of a disk home: a swap-in reads its block, a device
// placement's write-back overwrites it whole, a host placement's update (gradients home, the CPU
// AdamW) reads and changes it. Eviction is the cache's own rule, detail::evict_before: Belady's
// over the planned uses (a use of this step not yet made is next; a superseded block is never
// used again), among equals one that needs no write, then the least recently used. A miss reads
// the unit file, but for a whole overwrite, and a dirty block evicted is written to it unless it
// is superseded (its unit's device copy has an update its write-back brings home whole). Blocks
// are the files' sizes (4 KiB multiples); the cache's fragmentation and its reads ahead of use are
// not modelled: a read ahead takes only room that costs nothing (the same bytes, earlier).
class cache_replay {
 public:
  enum class access { read, overwrite, update };

  cache_replay(std::size_t capacity, std::vector<std::size_t> file_bytes)
      : capacity_(capacity), file_bytes_(std::move(file_bytes)), entries_(file_bytes_.size())
  {}

  [[nodiscard]] bool disk(std::size_t u) const { return file_bytes_[u] != 0; }

  /// A touch of unit u's home; `next_use(v)` is when v is used next (larger is later).
  template <typename Next>
  void touch(std::size_t u, access a, double counted, Next&& next_use)
  {
    if (!disk(u)) { return; }
    entry& e = entries_[u];
    e.last = ++tick_;
    if (!e.cached) {
      while (used_ + file_bytes_[u] > capacity_) {
        std::size_t victim = never;
        detail::cache_candidate best;
        for (std::size_t v = 0; v < entries_.size(); ++v) {
          if (v == u || !entries_[v].cached) { continue; }
          const detail::cache_candidate seen{.next_use = superseded_(v) ? never : next_use(v),
                                             .needs_write = entries_[v].dirty && !superseded_(v),
                                             .last_used = entries_[v].last,
                                             .id = v};
          if (victim == never || detail::evict_before(seen, best)) {
            victim = v;
            best = seen;
          }
        }
        if (victim == never) { break; }  // one home larger than the cache: the runtime refuses it
        entry& out = entries_[victim];
        if (out.dirty && !superseded_(victim)) { written_ += counted * static_cast<double>(file_bytes_[victim]); }
        out.cached = false;
        out.dirty = false;
        used_ -= file_bytes_[victim];
      }
      if (a != access::overwrite) { read_ += counted * static_cast<double>(file_bytes_[u]); }
      e.cached = true;
      used_ += file_bytes_[u];
    }
    if (a != access::read) { e.dirty = true; }
  }

  /// Whether a unit's block is superseded (the replay's device copies say).
  void superseded_when(std::function<bool(std::size_t)> when) { superseded_ = std::move(when); }
  [[nodiscard]] double read() const noexcept { return read_; }  // bytes read from the unit files
  [[nodiscard]] double written() const noexcept { return written_; }  // bytes written to them

 private:
  struct entry {
    bool cached = false;
    bool dirty = false;
    std::size_t last = 0;  // the tick of its last touch
  };
  std::size_t capacity_;
  std::vector<std::size_t> file_bytes_;  // 0: not a disk home
  std::vector<entry> entries_;
  std::size_t used_ = 0;
  std::size_t tick_ = 0;
  double read_ = 0;
  double written_ = 0;
  std::function<bool(std::size_t)> superseded_ = [](std::size_t) { return false; };
};

/// The step from which the trainer has not planned yet, seen from step `s` (never: all planned).
[[nodiscard]] std::size_t plan_horizon(const plan_input& in, std::size_t s);

/// A step's frozen uses (none where the input gives none).
[[nodiscard]] const std::vector<std::size_t>& frozen_uses(const plan_input& in, std::size_t s);

/// The replay of the steps' uses (frozen first, then trained, as the runtime acquires them) in
/// the room the pinned units leave; the host cache replayed beside it. Traffic counts in the step
/// that issues it (a prefetch's up to its lookahead earlier).
[[nodiscard]] traffic replay_steps(const plan_input& in, const std::vector<planned_unit>& units,
                                   const detail::residency_model& model, std::size_t room, cache_replay& cache);

/// The replay of steps given as the trainer's calls in order (plan_input::ordered).
[[nodiscard]] traffic replay_ordered(const plan_input& in, const std::vector<planned_unit>& units,
                                     const detail::residency_model& model, std::size_t room, cache_replay& cache);

}  // namespace taskswap::tools::replay
