// SPDX-License-Identifier: Apache-2.0
#include "planner_replay.hpp"

namespace taskswap::tools::replay {

std::size_t plan_horizon(const plan_input& in, std::size_t s)
{
  if (in.plan_window == 0) { return never; }
  return in.plan_window * (1 + (s + in.plan_margin) / in.plan_window);
}

const std::vector<std::size_t>& frozen_uses(const plan_input& in, std::size_t s)
{
  static const std::vector<std::size_t> none;
  return in.frozen.empty() ? none : in.frozen[s];
}

namespace {

// replay_steps' state: the runtime's victim rule (Belady within the prefetch horizon, least
// recently used beyond it and among equals) over the swapped units in the room the pinned ones
// leave, seeing only the steps planned so far (the runtime knows nothing beyond).
class step_replay {
 public:
  step_replay(const plan_input& in, const std::vector<planned_unit>& units, const detail::residency_model& model,
              std::size_t room, cache_replay& cache)
      : in_(in), units_(units), model_(model), room_(room), cache_(cache), last_use_(units.size(), 0)
  {}

  traffic run()
  {
    cache_.superseded_when([this](std::size_t v) {
      const auto it = resident_.find(v);
      return it != resident_.end() && it->second && units_[v].whole_write_back();
    });
    for (std::size_t s = 0; s < in_.steps.size(); ++s) {
      const std::vector<std::size_t>& frozen = frozen_uses(in_, s);
      std::vector<std::size_t> need(frozen);
      need.insert(need.end(), in_.steps[s].begin(), in_.steps[s].end());
      for (std::size_t k = 0; k < need.size(); ++k) { acquire(s, need, k, frozen.size()); }
      released(s, frozen, in_.steps[s]);
    }
    cache_.superseded_when([](std::size_t) { return false; });  // its predicate reads this replay's state
    return t_;
  }

 private:
  [[nodiscard]] std::size_t next_use(const planned_unit& p, std::size_t s) const
  {
    const std::size_t next = p.next_use_after(s);
    return next >= plan_horizon(in_, s) ? never : next;
  }
  [[nodiscard]] std::size_t slot_bytes(std::size_t u)
  {
    return params_only_[u] ? units_[u].fp.frozen_device_bytes : units_[u].fp.device_bytes;
  }

  // The k-th use of step s (`need`: its frozen uses, `frozen` of them, then its trained ones).
  void acquire(std::size_t s, const std::vector<std::size_t>& need, std::size_t k, std::size_t frozen)
  {
    const std::size_t u = need[k];
    const bool whole = k >= frozen;
    const planned_unit& p = units_[u];
    if (p.pinned() || (resident_.contains(u) && !(whole && params_only_[u]))) { return; }
    // For the host cache: a unit this step acquires later is used now, and so is one held for
    // training with host placement (its gradients come home at the step's end).
    const auto next_now = [&](std::size_t v) {
      const auto at = std::find(need.begin(), need.end(), v);
      const bool now =
        at != need.end() && (at >= need.begin() + static_cast<std::ptrdiff_t>(k) ||
                             (units_[v].host() && at >= need.begin() + static_cast<std::ptrdiff_t>(frozen)));
      return now ? s : next_use(units_[v], s);
    };
    // A prefetched unit's copy (and the eviction that makes its room) happens up to its
    // lookahead earlier: the runtime counts it in that step's figures, so the replay does too.
    const std::size_t issued = p.policy.residency == residency::prefetch
                                 ? s - std::min(s, static_cast<std::size_t>(std::max(p.policy.lookahead, 0)))
                                 : s;
    const double counted = issued >= in_.warmup_steps ? 1.0 : 0.0;
    const std::size_t bytes = whole ? p.fp.device_bytes : p.fp.frozen_device_bytes;
    if (resident_.contains(u)) {  // its parameters alone are here: it comes in whole
      used_ -= slot_bytes(u);
      resident_.erase(u);
    }
    // The runtime reads the home into the host cache (Note [Two hops]) while the swap-in's
    // victims are still resident; their write-backs reach the cache after that read.
    cache_.touch(u, cache_replay::access::read, counted, next_now);
    make_room(s, need, k, frozen, bytes, counted);
    t_.h2d += counted * static_cast<double>(whole ? p.fp.swap_in_bytes : p.fp.frozen_swap_in_bytes);
    t_.swap_ins += counted;
    for (const auto& [v, c] : written_home_) {
      cache_.touch(v, units_[v].whole_write_back() ? cache_replay::access::overwrite : cache_replay::access::update, c,
                   next_now);
    }
    written_home_.clear();
    used_ += bytes;
    resident_[u] = false;
    params_only_[u] = !whole;
  }

  // Evicts until `bytes` fit: the runtime's victim rule over the units not held, else a unit
  // held frozen in its whole slot gives up all but its parameters.
  void make_room(std::size_t s, const std::vector<std::size_t>& need, std::size_t k, std::size_t frozen,
                 std::size_t bytes, double counted)
  {
    const auto held_now = [&](std::size_t v) {  // acquired before this one in the step: not a victim
      return std::find(need.begin(), need.begin() + static_cast<std::ptrdiff_t>(k), v) !=
             need.begin() + static_cast<std::ptrdiff_t>(k);
    };
    while (used_ + bytes > room_) {
      candidates_.clear();
      for (const auto& [v, dirty] : resident_) {
        if (held_now(v)) { continue; }
        // A unit this step acquires later is needed now: Belady takes it last.
        const bool later_now = std::find(need.begin() + static_cast<std::ptrdiff_t>(k), need.end(), v) != need.end();
        const std::size_t next = later_now ? s : next_use(units_[v], s);
        candidates_.push_back({.unit = static_cast<std::uint32_t>(v),
                               .next_use = next,
                               .last_release = last_use_[v],
                               .idle = true,
                               .beyond = model_.beyond_horizon(s, next == never ? detail::no_next_step : next)});
      }
      const std::size_t chosen = detail::residency_model::choose_victim(candidates_);  // the runtime's rule
      if (chosen != candidates_.size()) {
        const std::size_t victim = candidates_[chosen].unit;
        if (resident_[victim]) { write_home(victim, counted); }
        used_ -= slot_bytes(victim);
        resident_.erase(victim);
        params_only_.erase(victim);
        continue;
      }
      // Nothing to evict: a unit held frozen in its whole slot gives up all but its parameters,
      // a clean one first, then the lowest index (the runtime's rule). Narrowing happens at an
      // acquire, so its write-back counts in this step.
      std::size_t wide = never;
      for (std::size_t i = 0; i < std::min(k, frozen); ++i) {
        const std::size_t v = need[i];
        if (!resident_.contains(v) || params_only_[v] || units_[v].pinned()) { continue; }
        if (wide == never || std::pair(resident_[v], v) < std::pair(resident_[wide], wide)) { wide = v; }
      }
      if (wide == never) { return; }  // cannot happen after the checks above: the held units fit
      if (resident_[wide]) { write_home(wide, s >= in_.warmup_steps ? 1.0 : 0.0); }
      used_ -= units_[wide].fp.device_bytes - units_[wide].fp.frozen_device_bytes;
      resident_[wide] = false;
      params_only_[wide] = true;
    }
  }

  void write_home(std::size_t v, double counted)  // a dirty device copy to its home
  {
    t_.d2h += counted * static_cast<double>(units_[v].fp.write_back_bytes);
    written_home_.emplace_back(v, counted);
  }

  // The step's releases: frozen uses change nothing; a trained one is dirty on the device, or
  // (host placement) goes home and stays only if used again within its lookahead.
  void released(std::size_t s, const std::vector<std::size_t>& frozen, const std::vector<std::size_t>& trained)
  {
    for (std::size_t u : frozen) { last_use_[u] = ++tick_; }
    const double counted = s >= in_.warmup_steps ? 1.0 : 0.0;
    for (std::size_t u : trained) {
      const planned_unit& p = units_[u];
      last_use_[u] = ++tick_;
      if (!p.host()) {
        if (!p.pinned()) { resident_[u] = true; }
        continue;
      }
      const std::size_t next = next_use(p, s);
      cache_.touch(u, cache_replay::access::update, counted, [&](std::size_t v) {
        const bool held_now = units_[v].host() && std::find(trained.begin(), trained.end(), v) != trained.end();
        return held_now ? s : next_use(units_[v], s);
      });
      if (!p.host_update(next == never ? never : next - s, counted, t_)) {
        used_ -= p.fp.device_bytes;
        resident_.erase(u);
        params_only_.erase(u);
      }
    }
  }

  const plan_input& in_;
  const std::vector<planned_unit>& units_;
  const detail::residency_model& model_;
  std::size_t room_;
  cache_replay& cache_;
  std::vector<std::size_t> last_use_;  // release order: a tick per release
  std::size_t tick_ = 0;
  std::map<std::size_t, bool> resident_;  // unit -> dirty
  std::map<std::size_t, bool> params_only_;  // resident with its parameters alone (a frozen use's)
  std::size_t used_ = 0;
  traffic t_;
  std::vector<detail::victim_candidate> candidates_;
  std::vector<std::pair<std::size_t, double>> written_home_;  // a swap-in's victims written back, counted
};

}  // namespace

traffic replay_steps(const plan_input& in, const std::vector<planned_unit>& units, const detail::residency_model& model,
                     std::size_t room, cache_replay& cache)
{
  return step_replay(in, units, model, room, cache).run();
}

namespace {

// The acquisitions of plan_input::ordered, numbered in call order across steps: each unit's
// positions, and the step of each position.
struct use_positions {
  std::vector<std::vector<std::size_t>> of_unit;
  std::vector<std::size_t> step_of;
  std::vector<unit_use> use_of;

  use_positions(const plan_input& in, std::size_t units) : of_unit(units)
  {
    for (std::size_t s = 0; s < in.ordered.size(); ++s) {
      for (const step_plan::entry& e : in.ordered[s].entries()) {
        if (!e.acquire) { continue; }
        of_unit.at(e.unit.value).push_back(step_of.size());
        step_of.push_back(s);
        use_of.push_back(e.use);
      }
    }
  }
};

}  // namespace

// The replay of steps given as the trainer's calls in order (plan_input::ordered): the runtime's
// victim rule over the positions of the uses within and across steps (the runtime's positions),
// the units held at the time never victims, a trained use written back when evicted after its update. Traffic counts in
// the step of its use.
traffic replay_ordered(const plan_input& in, const std::vector<planned_unit>& units,
                       const detail::residency_model& model, std::size_t room, cache_replay& cache)
{
  const use_positions uses(in, units.size());
  const std::vector<std::size_t>& step_of = uses.step_of;
  struct slot {
    bool dirty = false;
    bool params_only = false;
  };
  std::map<std::size_t, slot> resident;
  std::map<std::size_t, unit_use> held;  // unit -> the use it is held for
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
    const auto& q = uses.of_unit[u];
    const auto it = std::upper_bound(q.begin(), q.end(), after);
    return it == q.end() || step_of[*it] >= plan_horizon(in, s) ? never : *it;
  };
  // For the host cache: a unit held for training with host placement is in use now (its
  // gradients come home at release), as the runtime's host cache sees it.
  const auto cache_next = [&](std::size_t v, std::size_t after, std::size_t s) {
    const auto h = held.find(v);
    return h != held.end() && h->second == unit_use::train && units[v].host() ? after : next_use(v, after, s);
  };
  for (std::size_t s = 0; s < in.ordered.size(); ++s) {
    const double counted = s >= in.warmup_steps ? 1.0 : 0.0;
    const auto release = [&](std::size_t u, unit_use use) {
      last_release[u] = ++tick;
      const planned_unit& p = units[u];
      if (p.pinned()) { return; }
      if (p.activation) {  // a stash goes home at once; a last read frees the room
        const std::size_t next = next_use(u, position == 0 ? 0 : position - 1, s);
        if (use == unit_use::stash) {
          t.d2h += counted * static_cast<double>(p.fp.write_back_bytes);
        } else if (next == never || uses.use_of[next] != unit_use::frozen) {
          used -= bytes_of(u, resident[u]);
          resident.erase(u);
        }
        return;
      }
      if (use != unit_use::train) { return; }
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
      held[u] = e.use;
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
      if (e.use != unit_use::stash) {  // a stash's slot is written on the device
        t.h2d += counted * static_cast<double>(whole ? p.fp.swap_in_bytes : p.fp.frozen_swap_in_bytes);
        t.swap_ins += counted;
      }
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

}  // namespace taskswap::tools::replay
