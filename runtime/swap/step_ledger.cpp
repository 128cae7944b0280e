// SPDX-License-Identifier: Apache-2.0
// The runtime's counters and stall timers (runtime/swap/step_ledger.hpp).

#include "runtime/swap/step_ledger.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"

#include <taskswap/error.hpp>

namespace taskswap::detail {

step_ledger::step_ledger(const device& dev, std::size_t units, std::uint64_t first) : device_(dev), units_(units)
{
  current_.step = first;
}

void step_ledger::wait_timed(const event& arrived, stream_view s, bool measure)
{
  if (!measure) {
    arrived.wait(s);
    return;
  }
  if (stalls_free_.empty()) {
    stalls_free_.push_back({event(device_, {.timing = true}), event(device_, {.timing = true}), 0});
  }
  stall_timer t = std::move(stalls_free_.back());
  stalls_free_.pop_back();
  t.step = current_.step;
  t.begin.record(s);
  arrived.wait(s);
  t.end.record(s);
  stalls_pending_.push_back(std::move(t));
}

step_stats* step_ledger::stats_of(std::uint64_t step) noexcept
{
  if (step == current_.step) { return &current_; }
  const std::uint64_t oldest = current_.step - history_.size();
  return step >= oldest && step < current_.step ? &history_[step - oldest] : nullptr;
}

void step_ledger::resolve_stalls(bool wait, std::chrono::milliseconds timeout)
{
  auto it = stalls_pending_.begin();
  while (it != stalls_pending_.end()) {
    if (wait && !it->end.synchronize_for(timeout)) {
      throw timeout_error(message("flush: a swap-in's stall timer on the trainer's stream has not completed within ",
                                  timeout.count(), " ms ([runtime] timeout): the trainer's stream is stalled"));
    }
    if (!it->end.query()) {
      ++it;
      continue;
    }
    const double ms = elapsed_ms(it->begin, it->end);
    if (step_stats* s = stats_of(it->step)) { s->stall_ms += ms; }
    if (it->step != current_.step) { total_.stall_ms += ms; }
    stalls_free_.push_back(std::move(*it));
    it = stalls_pending_.erase(it);
  }
}

step_stats step_ledger::close(std::size_t device_used)
{
  resolve_stalls(false, {});
  const step_stats done = current_;
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
  if (history_.size() > stats_history) { history_.pop_front(); }
  current_ = step_stats{};
  current_.step = done.step + 1;
  current_.peak_device_bytes = device_used;
  return done;
}

void step_ledger::report(runtime_stats& s) const
{
  s.total = total_;
  s.steps.assign(history_.begin(), history_.end());
  TASKSWAP_EXPECTS(s.units.size() == units_.size(),
                   message("step_ledger::report: ", s.units.size(), " unit stats for ", units_.size(), " units"));
  for (std::size_t i = 0; i < units_.size(); ++i) {
    s.units[i].swap_ins = units_[i].swap_ins;
    s.units[i].write_backs = units_[i].write_backs;
  }
}

}  // namespace taskswap::detail
