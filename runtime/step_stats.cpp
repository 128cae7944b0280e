// SPDX-License-Identifier: Apache-2.0
// Per-step stats, stall timers on the trainer's stream, trace tracks, and runtime::stats.

#include "runtime/runtime_impl.hpp"

#include <algorithm>

namespace taskswap {

using detail::message;
using detail::state_of;

step_stats* runtime::impl::stats_of(std::uint64_t step)
{
  if (step == steps_done_) { return &current_; }
  const std::uint64_t oldest = steps_done_ - history_.size();
  return step >= oldest ? &history_[step - oldest] : nullptr;
}

void runtime::impl::resolve_stalls(bool wait)
{
  auto it = stalls_pending_.begin();
  while (it != stalls_pending_.end()) {
    if (wait && !it->end.synchronize_for(options_.timeout)) {
      throw timeout_error(message("flush: a swap-in's stall timer on the trainer's stream has not completed within ",
                                  options_.timeout.count(),
                                  " ms ([runtime] timeout): the trainer's stream is stalled"));
    }
    if (!it->end.query()) {
      ++it;
      continue;
    }
    const double ms = elapsed_ms(it->begin, it->end);
    if (step_stats* s = stats_of(it->step)) { s->stall_ms += ms; }
    if (it->step != steps_done_) { total_.stall_ms += ms; }
    stalls_free_.push_back(std::move(*it));
    it = stalls_pending_.erase(it);
  }
}

int runtime::impl::compute_track(stream_view s)
{
  const auto [it, inserted] = compute_tracks_.try_emplace(s.native_handle(), 0);
  if (inserted) { it->second = trace_->track("compute " + std::to_string(compute_tracks_.size())); }
  return it->second;
}

// Closes the current step's stats: adds them to the totals and the history, and opens the next.
step_stats runtime::impl::close_step_stats()
{
  resolve_stalls(false);
  current_.step = steps_done_;
  step_stats done = current_;
  step_stats& t = total_;
  t.h2d_bytes += done.h2d_bytes;
  t.d2h_bytes += done.d2h_bytes;
  t.hits += done.hits;
  t.misses += done.misses;
  t.unplanned += done.unplanned;
  t.frozen += done.frozen;
  t.swap_ins += done.swap_ins;
  t.write_backs += done.write_backs;
  t.evictions += done.evictions;
  t.stall_ms += done.stall_ms;
  t.peak_device_bytes = std::max(t.peak_device_bytes, done.peak_device_bytes);
  t.reduced_bytes += done.reduced_bytes;
  t.reduce_all_bytes += done.reduce_all_bytes;
  history_.push_back(done);
  if (history_.size() > detail::stats_history) { history_.pop_front(); }
  ++steps_done_;
  current_ = step_stats{};
  current_.peak_device_bytes = pool_->stats().used;
  return done;
}

runtime_stats runtime::impl::stats()
{
  resolve_stalls(false);
  runtime_stats s;
  s.total = total_;
  s.steps.assign(history_.begin(), history_.end());
  const detail::device_pool_stats pool = pool_->stats();
  s.budget = pool.budget;
  s.pinned_device_bytes = model_->pinned_bytes();
  s.device_bytes_in_use = pool.used;
  s.device_granule = pool.granule;
  s.device_rounding_bytes = pool.used - pool.requested;
  const pinned_arena_stats arena = homes_.arena->stats();
  s.home_bytes = arena.used;
  s.host_bytes_pinned = arena.pinned;
  s.units.reserve(units_.size());
  for (const unit_record& r : units_) {
    s.units.push_back(unit_stats{r.name, state_of(r), r.dirty, r.layout.device_bytes, r.layout.home_bytes, r.swap_ins,
                                 r.write_backs, r.step, r.policy});
  }
  return s;
}

}  // namespace taskswap
