// SPDX-License-Identifier: Apache-2.0
#include "planner.hpp"

#include "runtime/residency_model.hpp"
#include "storage/host_cache.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace taskswap::tools {
namespace {

constexpr std::size_t page = 4096;
constexpr std::size_t never = std::numeric_limits<std::size_t>::max();

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

void check_rules(const plan_input& in)
{
  for (const unit_rule& rule : in.options.units) {
    const bool used = std::any_of(in.units.begin(), in.units.end(), [&](const unit_spec& u) {
      return !u.policy && fnmatch(rule.match.c_str(), u.name.c_str(), 0) == 0;
    });
    if (!used) {
      throw config_error((rule.origin.empty() ? in.options.source : rule.origin) + ": [[units]] match = \"" +
                         rule.match + "\" matches no unit of the model; fix the pattern or remove the rule");
    }
  }
}

// The step from which the trainer has not planned yet, seen from step `s` (never: all planned).
std::size_t plan_horizon(const plan_input& in, std::size_t s)
{
  if (in.plan_window == 0) { return never; }
  return in.plan_window * (1 + (s + in.plan_margin) / in.plan_window);
}

// The replay of steps given as the trainer's calls in order (plan_input::ordered): the runtime's
// victim rule over the positions of the uses within and across steps (the runtime's positions),
// the units held at the time never victims, a trained use written back when evicted after its update. Traffic counts in
// the step of its use.
traffic replay_ordered(const plan_input& in, const std::vector<planned_unit>& units,
                       const detail::residency_model& model, std::size_t room, cache_replay& cache)
{
  std::vector<std::vector<std::size_t>> positions(units.size());  // of each unit's acquisitions
  std::vector<std::size_t> step_of;  // the step of each position
  for (std::size_t s = 0; s < in.ordered.size(); ++s) {
    for (const step_plan::entry& e : in.ordered[s].entries()) {
      if (!e.acquire) { continue; }
      positions.at(e.unit.value).push_back(step_of.size());
      step_of.push_back(s);
    }
  }
  struct slot {
    bool dirty = false;
    bool params_only = false;
  };
  std::map<std::size_t, slot> resident;
  std::map<std::size_t, bool> held;  // unit -> held for a trained use
  std::vector<std::size_t> last_release(units.size(), 0);
  std::size_t tick = 0;
  std::size_t used = 0;
  std::size_t position = 0;
  traffic t;
  std::vector<detail::victim_candidate> candidates;
  std::vector<std::size_t> written_home;  // this swap-in's victims written back
  cache.superseded_when([&](std::size_t v) {
    const auto r = resident.find(v);
    return r != resident.end() && r->second.dirty && units[v].whole_write_back();
  });
  const auto bytes_of = [&](std::size_t u, const slot& sl) {
    return sl.params_only ? units[u].fp.frozen_device_bytes : units[u].fp.device_bytes;
  };
  const auto next_use = [&](std::size_t u, std::size_t after, std::size_t s) {
    const auto& q = positions[u];
    const auto it = std::upper_bound(q.begin(), q.end(), after);
    return it == q.end() || step_of[*it] >= plan_horizon(in, s) ? never : *it;
  };
  // For the host cache: a unit held for training with host placement is in use now (its
  // gradients come home at release), as the runtime's host cache sees it.
  const auto cache_next = [&](std::size_t v, std::size_t after, std::size_t s) {
    const auto h = held.find(v);
    return h != held.end() && h->second && units[v].host() ? after : next_use(v, after, s);
  };
  for (std::size_t s = 0; s < in.ordered.size(); ++s) {
    const double counted = s >= in.warmup_steps ? 1.0 : 0.0;
    const auto release = [&](std::size_t u, bool trained) {
      last_release[u] = ++tick;
      const planned_unit& p = units[u];
      if (!trained || p.pinned()) { return; }
      if (!p.host()) {
        resident[u].dirty = true;
        return;
      }
      // `position` is the index of the next acquisition: a use there is the next one.
      const std::size_t after = position == 0 ? 0 : position - 1;
      const std::size_t next = next_use(u, after, s);
      cache.touch(u, cache_replay::access::update, counted, [&](std::size_t v) { return cache_next(v, after, s); });
      if (!p.host_update(next == never ? never : step_of[next] - s, counted, t)) {
        used -= bytes_of(u, resident[u]);
        resident.erase(u);
      }
    };
    for (const step_plan::entry& e : in.ordered[s].entries()) {
      const std::size_t u = e.unit.value;
      if (!e.acquire) {
        const auto h = held.find(u);
        if (h != held.end()) {
          release(u, h->second);
          held.erase(h);
        }
        continue;
      }
      const std::size_t here = position++;
      const bool whole = e.use == unit_use::train;
      held[u] = whole;
      const planned_unit& p = units[u];
      if (p.pinned()) { continue; }
      const auto r = resident.find(u);
      if (r != resident.end() && (!whole || !r->second.params_only)) { continue; }  // a hit
      if (r != resident.end()) {  // its parameters alone are here: it comes in whole
        used -= bytes_of(u, r->second);
        resident.erase(r);
      }
      const std::size_t bytes = whole ? p.fp.device_bytes : p.fp.frozen_device_bytes;
      const auto next_here = [&](std::size_t w) { return cache_next(w, here, s); };
      // The runtime reads the home into the host cache (Note [Two hops]) while the swap-in's
      // victims are still resident; their write-backs reach the cache after that read.
      cache.touch(u, cache_replay::access::read, counted, next_here);
      while (used + bytes > room) {
        candidates.clear();
        for (const auto& [v, sl] : resident) {
          if (held.contains(v)) { continue; }
          const std::size_t next = next_use(v, here, s);
          candidates.push_back(
            {.unit = static_cast<std::uint32_t>(v),
             .next_use = next,
             .last_release = last_release[v],
             .idle = true,
             .beyond = model.beyond_horizon(s, next == never ? detail::no_next_step : step_of[next])});
        }
        const std::size_t k = detail::residency_model::choose_victim(candidates);  // the runtime's rule
        if (k == candidates.size()) { break; }  // cannot happen after the plan check: the held units fit
        const std::size_t v = candidates[k].unit;
        if (resident[v].dirty) {
          t.d2h += counted * static_cast<double>(units[v].fp.write_back_bytes);
          written_home.push_back(v);
        }
        used -= bytes_of(v, resident[v]);
        resident.erase(v);
      }
      t.h2d += counted * static_cast<double>(whole ? p.fp.swap_in_bytes : p.fp.frozen_swap_in_bytes);
      t.swap_ins += counted;
      for (const std::size_t v : written_home) {
        cache.touch(v, units[v].whole_write_back() ? cache_replay::access::overwrite : cache_replay::access::update,
                    counted, next_here);
      }
      written_home.clear();
      resident[u] = {.dirty = false, .params_only = !whole};
      used += bytes;
    }
    for (const auto& [u, trained] : held) { release(u, trained); }  // held to the step's end
    held.clear();
  }
  cache.superseded_when([](std::size_t) { return false; });  // its predicate reads this replay's state
  return t;
}

}  // namespace

std::string bytes_text(double bytes)
{
  static constexpr std::array<const char*, 5> units{"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t i = 0;
  while (std::fabs(bytes) >= 1024.0 && i + 1 < units.size()) {
    bytes /= 1024.0;
    ++i;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, i == 0 ? "%.0f %s" : "%.1f %s", bytes, units[i]);
  return buf;
}

double parse_rate(std::string_view text)
{
  std::string t(text);
  const auto slash = t.rfind("/s");
  if (slash == std::string::npos || slash + 2 != t.size()) {
    throw config_error("\"" + t + "\" is not a rate; write e.g. \"25 GB/s\"");
  }
  return static_cast<double>(parse_size(t.substr(0, slash)));
}

std::int64_t largest_batch(std::size_t device_memory, std::size_t reserved, std::size_t fixed, std::size_t per_sample)
{
  if (per_sample == 0 || device_memory <= reserved + fixed) { return 0; }
  return static_cast<std::int64_t>((device_memory - reserved - fixed) / per_sample);
}

plan_report make_plan(const plan_input& in)
{
  check_rules(in);
  plan_report r;
  r.units = in.units.size();
  r.budget = in.options.device.budget;
  r.steps = in.steps.size();
  r.granule = in.granule;
  // The budget's rules, the registration checks and the plan check are the runtime's own
  // (Note [One residency model]): the planner adds the replay and the figures.
  const bool guarded = in.options.scaler.enabled || in.options.optimizer.clip > 0;
  std::vector<planned_unit> units;
  std::vector<detail::modelled_unit> modelled;
  for (const unit_spec& spec : in.units) {
    planned_unit p;
    p.policy = policy_for(spec, in.options);
    p.cached = home_is_cached(p.policy);
    if (p.policy.lookahead < 0) {
      throw config_error("unit '" + spec.name + "': lookahead " + std::to_string(p.policy.lookahead) +
                         " is negative; use 0 or more");
    }
    p.fp = footprint(spec, p.policy.optimizer);
    r.all_resident_bytes += (footprint(spec, optimizer_placement::device).device_bytes + 255) / 256 * 256;
    if (p.disk()) {
      ++r.disk_units;
      r.disk_bytes += (p.fp.home_bytes + page - 1) / page * page;
    } else {
      r.pinned_host_bytes += p.fp.home_bytes;
    }
    if (p.pinned()) { ++r.pinned_units; }
    modelled.push_back({.name = spec.name,
                        .device_bytes = p.fp.device_bytes,
                        .params_bytes = p.fp.frozen_device_bytes,
                        .reduce_bytes = p.fp.reduce_bytes,
                        .pinned = p.pinned(),
                        .host_placement = p.host(),
                        .never_trained = !spec.trainable,
                        .lookahead = p.policy.residency == residency::prefetch ? p.policy.lookahead : -1});
    units.push_back(std::move(p));
  }
  const detail::residency_model model(r.budget, in.granule, guarded ? step_guard_device_bytes(in.units.size()) : 0,
                                      std::move(modelled));
  const std::size_t guard = model.guard_bytes();
  r.pinned_device_bytes = model.pinned_bytes();
  r.all_resident_bytes = model.taken(r.all_resident_bytes);  // all pinned: packed, then whole granules
  if (r.disk_units > 0) {
    r.host_cache_bytes = in.options.storage.host_cache;
    r.pinned_host_bytes += r.host_cache_bytes;
  }
  r.pinned_host_bytes = (r.pinned_host_bytes + page - 1) / page * page;
  if (!in.frozen.empty() && in.frozen.size() != in.steps.size()) {
    throw config_error("the plan has " + std::to_string(in.steps.size()) + " steps but frozen uses for " +
                       std::to_string(in.frozen.size()) + "; give one list per step, or none");
  }
  static const std::vector<std::size_t> none;
  const auto frozen_of = [&](std::size_t s) -> const std::vector<std::size_t>& {
    return in.frozen.empty() ? none : in.frozen[s];
  };
  for (std::size_t s = 0; s < in.steps.size(); ++s) {
    for (const auto* list : {&frozen_of(s), &in.steps[s]}) {
      for (std::size_t u : *list) {
        if (units.at(u).uses.empty() || units[u].uses.back() != s) { units[u].uses.push_back(s); }
      }
    }
  }
  std::vector<std::size_t> file_bytes(units.size(), 0);  // 0: not a disk home
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (units[i].disk()) { file_bytes[i] = (units[i].fp.home_bytes + page - 1) / page * page; }
  }
  // Each step as the runtime checks it (its frozen uses first, as the replay acquires them).
  std::size_t most_held = 0;
  std::size_t most_held_raw = 0;  // the same units' slabs, before rounding
  if (!in.ordered.empty() && in.ordered.size() != in.steps.size()) {
    throw config_error("the plan has " + std::to_string(in.steps.size()) + " steps but " +
                       std::to_string(in.ordered.size()) + " ordered ones; give one per step, or none");
  }
  // With a communicator a unit released whole keeps its room until its bucket's reduction is
  // launched (this rank's units alone known: the runtime's check before the ranks agree), and in
  // a guarded step a trained one keeps it to the step's end (its update waits for end_step).
  const bool communicator = in.options.comm.backend != comm_backend::none;
  for (std::size_t s = 0; s < in.steps.size(); ++s) {
    // The trainer's calls where given; else the step's frozen uses, then its trained ones.
    step_plan step = in.ordered.empty() ? step_plan{} : in.ordered[s];
    for (std::size_t u : in.ordered.empty() ? frozen_of(s) : none) {
      step.acquire(unit_id{static_cast<std::uint32_t>(u)}, unit_use::frozen);
    }
    for (std::size_t u : in.ordered.empty() ? in.steps[s] : none) {
      step.acquire(unit_id{static_cast<std::uint32_t>(u)});
    }
    const std::vector<std::size_t> points =
      communicator ? model.local_reduction_points(step, in.options.comm.bucket_cap) : std::vector<std::size_t>{};
    const detail::step_peak peak = model.check_step(
      step, s, {.wait_for_reduction = communicator, .trained_count_to_end = guarded, .reduction_points = points});
    if (peak.held > most_held || (peak.held == most_held && peak.raw > most_held_raw)) {
      most_held = peak.held;
      most_held_raw = peak.raw;
    }
    // The disk homes it keeps in the host cache at once, as the runtime's plan check counts them.
    const detail::homes_in_use homes = detail::count_homes_in_use(
      step, [&](std::uint32_t u) { return file_bytes[u]; },
      [&](const step_plan::entry& e) { return units[e.unit.value].host() && e.use == unit_use::train; },
      guarded || communicator);
    r.host_cache_step_bytes = std::max(r.host_cache_step_bytes, homes.bytes);
  }
  r.peak_device_bytes = r.pinned_device_bytes + most_held + guard;
  r.rounding_bytes = r.peak_device_bytes - guard - model.pinned_packed_bytes() - most_held_raw;
  const std::size_t room = model.capacity() - model.pinned_bytes();
  // From here on, what each swapped unit's uses take of the budget.
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (units[i].pinned()) { continue; }
    units[i].fp.device_bytes = model.use_charge(static_cast<std::uint32_t>(i), true);
    units[i].fp.frozen_device_bytes = model.use_charge(static_cast<std::uint32_t>(i), false);
  }

  // Replay: the runtime's victim rule (Belady within the prefetch horizon, least recently used
  // beyond it and among equals) over the swapped units in the room the pinned ones leave, seeing
  // only the steps planned so far (the runtime knows nothing beyond).
  const auto next_use = [&](const planned_unit& p, std::size_t s) {
    const std::size_t next = p.next_use_after(s);
    return next >= plan_horizon(in, s) ? never : next;
  };
  std::vector<std::size_t> last_use(units.size(), 0);  // release order: a tick per release
  std::size_t tick = 0;
  std::map<std::size_t, bool> resident;  // unit -> dirty
  std::map<std::size_t, bool> params_only;  // resident with its parameters alone (a frozen use's)
  std::size_t used = 0;
  const auto slot_bytes = [&](std::size_t u) {
    return params_only[u] ? units[u].fp.frozen_device_bytes : units[u].fp.device_bytes;
  };
  traffic t;
  std::vector<detail::victim_candidate> candidates;
  cache_replay cache(in.options.storage.host_cache, file_bytes);
  // The trainer writes the homes' initial values through home() in the units' order before the
  // first step, with nothing planned yet (as the sample does): the cache keeps the last ones,
  // dirty, and their writes come in the steps (the others' are the set-up's, not counted). A
  // resumed run, or a trainer that writes none, starts otherwise: its first steps differ by up
  // to the cache's blocks.
  for (std::size_t i = 0; i < units.size(); ++i) {
    cache.touch(i, cache_replay::access::overwrite, 0.0, [](std::size_t) { return never; });
  }
  std::vector<std::pair<std::size_t, double>> written_home;  // a swap-in's victims written back, counted
  if (!in.ordered.empty()) { t = replay_ordered(in, units, model, room, cache); }
  cache.superseded_when([&](std::size_t v) {
    const auto it = resident.find(v);
    return it != resident.end() && it->second && units[v].whole_write_back();
  });
  for (std::size_t s = 0; s < (in.ordered.empty() ? in.steps.size() : 0); ++s) {
    const std::vector<std::size_t>& trained = in.steps[s];
    const std::vector<std::size_t>& frozen = frozen_of(s);
    std::vector<std::size_t> need(frozen);
    need.insert(need.end(), trained.begin(), trained.end());
    for (std::size_t k = 0; k < need.size(); ++k) {
      // Acquired before this one in the step: held, so not a victim (as the runtime's acquire).
      const auto held_now = [&](std::size_t v) {
        return std::find(need.begin(), need.begin() + static_cast<std::ptrdiff_t>(k), v) !=
               need.begin() + static_cast<std::ptrdiff_t>(k);
      };
      const std::size_t u = need[k];
      const bool whole = k >= frozen.size();
      const planned_unit& p = units[u];
      // For the host cache: a unit this step acquires later is used now, and so is one held for
      // training with host placement (its gradients come home at the step's end).
      const auto next_now = [&](std::size_t v) {
        const auto at = std::find(need.begin(), need.end(), v);
        const bool now =
          at != need.end() && (at >= need.begin() + static_cast<std::ptrdiff_t>(k) ||
                               (units[v].host() && at >= need.begin() + static_cast<std::ptrdiff_t>(frozen.size())));
        return now ? s : next_use(units[v], s);
      };
      if (p.pinned() || (resident.contains(u) && !(whole && params_only[u]))) { continue; }
      // A prefetched unit's copy (and the eviction that makes its room) happens up to its
      // lookahead earlier: the runtime counts it in that step's figures, so the replay does too.
      const std::size_t issued = p.policy.residency == residency::prefetch
                                   ? s - std::min(s, static_cast<std::size_t>(std::max(p.policy.lookahead, 0)))
                                   : s;
      const double counted = issued >= in.warmup_steps ? 1.0 : 0.0;
      const std::size_t bytes = whole ? p.fp.device_bytes : p.fp.frozen_device_bytes;
      if (resident.contains(u)) {  // its parameters alone are here: it comes in whole
        used -= slot_bytes(u);
        resident.erase(u);
      }
      // The runtime reads the home into the host cache (Note [Two hops]) while the swap-in's
      // victims are still resident; their write-backs reach the cache after that read.
      cache.touch(u, cache_replay::access::read, counted, next_now);
      while (used + bytes > room) {
        candidates.clear();
        for (const auto& [v, dirty] : resident) {
          if (held_now(v)) { continue; }
          // A unit this step acquires later is needed now: Belady takes it last.
          const bool later_now = std::find(need.begin() + static_cast<std::ptrdiff_t>(k), need.end(), v) != need.end();
          const std::size_t next = later_now ? s : next_use(units[v], s);
          candidates.push_back({.unit = static_cast<std::uint32_t>(v),
                                .next_use = next,
                                .last_release = last_use[v],
                                .idle = true,
                                .beyond = model.beyond_horizon(s, next == never ? detail::no_next_step : next)});
        }
        const std::size_t chosen = detail::residency_model::choose_victim(candidates);  // the runtime's rule
        const std::size_t victim = chosen == candidates.size() ? never : candidates[chosen].unit;
        const auto write_home = [&](std::size_t v, double c) {  // a dirty device copy to its home
          t.d2h += c * static_cast<double>(units[v].fp.write_back_bytes);
          written_home.emplace_back(v, c);
        };
        if (victim != never) {
          if (resident[victim]) { write_home(victim, counted); }
          used -= slot_bytes(victim);
          resident.erase(victim);
          params_only.erase(victim);
          continue;
        }
        // Nothing to evict: a unit held frozen in its whole slot gives up all but its parameters,
        // a clean one first, then the lowest index (the runtime's rule). Narrowing happens at an
        // acquire, so its write-back counts in this step.
        std::size_t wide = never;
        for (std::size_t i = 0; i < std::min(k, frozen.size()); ++i) {
          const std::size_t v = frozen[i];
          if (!resident.contains(v) || params_only[v] || units[v].pinned()) { continue; }
          if (wide == never || std::pair(resident[v], v) < std::pair(resident[wide], wide)) { wide = v; }
        }
        if (wide == never) { break; }  // cannot happen after the checks above: the held units fit
        if (resident[wide]) { write_home(wide, s >= in.warmup_steps ? 1.0 : 0.0); }
        used -= units[wide].fp.device_bytes - units[wide].fp.frozen_device_bytes;
        resident[wide] = false;
        params_only[wide] = true;
      }
      t.h2d += counted * static_cast<double>(whole ? p.fp.swap_in_bytes : p.fp.frozen_swap_in_bytes);
      t.swap_ins += counted;
      for (const auto& [v, c] : written_home) {
        cache.touch(v, units[v].whole_write_back() ? cache_replay::access::overwrite : cache_replay::access::update, c,
                    next_now);
      }
      written_home.clear();
      used += bytes;
      resident[u] = false;
      params_only[u] = !whole;
    }
    for (std::size_t u : frozen) { last_use[u] = ++tick; }  // clean: a frozen use changes nothing
    const double counted = s >= in.warmup_steps ? 1.0 : 0.0;
    for (std::size_t u : trained) {
      const planned_unit& p = units[u];
      last_use[u] = ++tick;
      if (!p.host()) {
        if (!p.pinned()) { resident[u] = true; }
        continue;
      }
      const std::size_t next = next_use(p, s);
      cache.touch(u, cache_replay::access::update, counted, [&](std::size_t v) {
        const bool held_now = units[v].host() && std::find(trained.begin(), trained.end(), v) != trained.end();
        return held_now ? s : next_use(units[v], s);
      });
      if (!p.host_update(next == never ? never : next - s, counted, t)) {
        used -= p.fp.device_bytes;
        resident.erase(u);
        params_only.erase(u);
      }
    }
  }
  const double n =
    std::max<double>(1.0, static_cast<double>(in.steps.size() - std::min(in.warmup_steps, in.steps.size())));
  r.disk_read_bytes_per_step = cache.read() / n;
  r.disk_write_bytes_per_step = cache.written() / n;
  r.disk_read_bytes_per_second = in.disk_read_bytes_per_second;
  r.disk_write_bytes_per_second = in.disk_write_bytes_per_second;
  r.disk_source = in.disk_source;
  if (in.disk_read_bytes_per_second > 0 && in.disk_write_bytes_per_second > 0) {
    r.disk_ms_per_step = (r.disk_read_bytes_per_step / in.disk_read_bytes_per_second +
                          r.disk_write_bytes_per_step / in.disk_write_bytes_per_second) *
                         1e3;
  }
  r.h2d_bytes_per_step = t.h2d / n;
  r.d2h_bytes_per_step = t.d2h / n;
  r.swap_ins_per_step = t.swap_ins / n;
  r.link_bytes_per_second = in.link_bytes_per_second;
  r.link_source = in.link_source;
  if (in.link_bytes_per_second > 0) {
    r.transfer_ms_per_step = std::max(r.h2d_bytes_per_step, r.d2h_bytes_per_step) / in.link_bytes_per_second * 1e3;
  }
  r.device_memory = in.device_memory;
  r.bytes_per_sample = in.bytes_per_sample;
  r.fixed_bytes = in.fixed_bytes;
  if (in.device_memory > 0 && in.bytes_per_sample > 0) {
    r.max_batch = largest_batch(in.device_memory, r.budget, in.fixed_bytes, in.bytes_per_sample);
    r.max_batch_all_resident =
      largest_batch(in.device_memory, r.all_resident_bytes, in.fixed_bytes, in.bytes_per_sample);
  }
  return r;
}

std::size_t disk_homed_units(const plan_input& in)
{
  return static_cast<std::size_t>(std::count_if(in.units.begin(), in.units.end(), [&](const unit_spec& spec) {
    return home_is_cached(policy_for(spec, in.options));
  }));
}

}  // namespace taskswap::tools
