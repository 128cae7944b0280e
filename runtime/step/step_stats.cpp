// SPDX-License-Identifier: Apache-2.0
// runtime::stats (its counters are the step ledger's, runtime/swap/step_ledger.hpp) and trace tracks.

#include "runtime/runtime_impl.hpp"

#include <algorithm>

namespace taskswap {

using detail::state_of;

int runtime::impl::compute_track(stream_view s)
{
  const auto [it, inserted] = trace_.compute.try_emplace(s.native_handle(), 0);
  if (inserted) { it->second = trace_.recorder->track("compute " + std::to_string(trace_.compute.size())); }
  return it->second;
}

runtime_stats runtime::impl::stats()
{
  ledger_.resolve_stalls(false, options_.timeout);
  runtime_stats s;
  const detail::device_pool_stats pool = memory_.pool->stats();
  s.budget = pool.budget;
  s.pinned_device_bytes = residency_.model->pinned_bytes();
  s.device_bytes_in_use = pool.used;
  s.device_granule = pool.granule;
  s.device_rounding_bytes = pool.used - pool.requested;
  const pinned_arena_stats arena = memory_.homes.arena->stats();
  s.home_bytes = arena.used;
  s.host_bytes_pinned = arena.pinned;
  if (memory_.homes.cache) {
    const detail::host_cache_stats c = memory_.homes.cache->stats();
    s.disk = {.host_cache_bytes = memory_.homes.cache->capacity(),
              .cached_bytes = c.used_bytes,
              .hits = c.hits,
              .misses = c.misses,
              .evictions = c.evictions,
              .written_back = c.written_back,
              .prefetches = c.prefetches,
              .wait_ms = c.wait_seconds * 1e3,
              .read_bytes = c.bytes_read,
              .written_bytes = c.bytes_written,
              .requests = memory_.homes.files->stats().requests};
  }
  s.units.reserve(units_.size());
  for (const unit_record& r : units_) {
    s.units.push_back(unit_stats{.name = r.name,
                                 .state = state_of(r),
                                 .dirty = r.dirty(),
                                 .device_bytes = r.layout.device_bytes,
                                 .home_bytes = r.layout.home_bytes,
                                 .step = r.step,
                                 .policy = r.policy});
  }
  ledger_.report(s);  // the totals, the history, each unit's swap-ins and write-backs
  return s;
}

}  // namespace taskswap
