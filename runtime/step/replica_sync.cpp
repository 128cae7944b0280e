// SPDX-License-Identifier: Apache-2.0
// Replicas start equal: at the first plan() with a communicator, rank 0's home copies are
// broadcast to every rank, or every rank's are compared with rank 0's ([comm] initial).

#include "runtime/runtime_impl.hpp"

#include "storage/crc32c.hpp"

#include <algorithm>

namespace taskswap {

using detail::bytes_text;
using detail::message;

namespace {

// The part of a home block that is a replica's state: params (derived from the master for
// bf16/f16 units, equal anyway), master, m and v (a unit never trained: its params alone);
// never the home gradients of host placement.
std::size_t state_bytes_of(const detail::unit_layout& l) { return l.v + l.state_bytes; }

// Each rank puts a checksum of every unit's state (and its step count) in its own row; the sum
// gives every rank every row, and every rank refuses with the same text.
void verify_replicas(detail::reducer& red, detail::unit_table& units)
{
  const auto world = static_cast<std::size_t>(red.world());
  const auto rank = static_cast<std::size_t>(red.rank());
  const std::size_t n = units.size();
  std::vector<std::int64_t> sums(world * n, 0);
  for (std::size_t u = 0; u < n; ++u) {
    const detail::unit_record& r = units[u];
    const detail::unit_layout& l = r.layout;
    const std::byte* home = r.home_block();
    if (l.activation) { continue; }  // scratch: each rank's own activations
    std::uint32_t crc = detail::crc32c(std::as_bytes(std::span(&r.step, 1)));
    if (l.frozen) {  // its parameters are its whole state
      sums[rank * n + u] = detail::crc32c(std::span<const std::byte>(home + l.params, l.params_bytes), crc);
      continue;
    }
    crc = detail::crc32c(std::span<const std::byte>(home + l.master, l.count * 4), crc);
    crc = detail::crc32c(std::span<const std::byte>(home + l.m, l.count * 4), crc);
    crc = detail::crc32c(std::span<const std::byte>(home + l.v, l.count * 4), crc);
    if (l.compute != dtype::f32) {  // state tensors live in the parameters alone
      crc = detail::crc32c(std::span<const std::byte>(home + l.state_at(), l.state_tensor_bytes()), crc);
    }
    sums[rank * n + u] = crc;
  }
  red.sum(sums, "the first plan: comparison of the initial replicas");
  std::string differ;
  std::size_t units_differing = 0;
  for (std::size_t u = 0; u < n; ++u) {
    std::string ranks;
    for (std::size_t k = 1; k < world; ++k) {
      if (sums[k * n + u] != sums[u]) { ranks += (ranks.empty() ? "" : ", ") + std::to_string(k); }
    }
    if (ranks.empty()) { continue; }
    if (++units_differing <= 8) {
      differ += message(differ.empty() ? "" : "; ", "'", units[u].name, "' on rank(s) ", ranks);
    }
  }
  if (units_differing == 0) { return; }
  throw config_error(
    message("[comm] initial = \"verify\": ", units_differing, " unit(s) start different from rank 0's: ", differ,
            units_differing > 8 ? "; ..." : "",
            ". Initialise every rank the same way (the same seed, or load one checkpoint), or set [comm] "
            "initial = \"broadcast\" to copy rank 0's"));
}

// Rank 0's state through a staging range of the device (the communicator moves device memory),
// unit by unit, in pieces; the ranks' step counts by a sum of rank 0's alone. The staging range
// is free room of the pool or, where the pinned units take (nearly) all of it, the largest pinned
// unit's slot, which is filled from its home copy afterwards (start() does that, or a refill).
void broadcast_replicas(runtime::impl& rt)
{
  detail::reducer& red = rt.reduced_->reduction();
  const bool root = red.rank() == 0;
  std::size_t largest = 0;
  for (const detail::unit_record& r : rt.units_) { largest = std::max(largest, state_bytes_of(r.layout)); }
  const std::size_t free = rt.memory_.pool->free();
  detail::unit_record* borrowed = nullptr;
  for (detail::unit_record& r : rt.units_) {
    if (r.pinned() && r.slot && (borrowed == nullptr || r.slot->size() > borrowed->slot->size())) { borrowed = &r; }
  }
  std::optional<device_span> own;
  std::optional<detail::device_pool::slot_id> own_slot;
  if (free > 0 && (borrowed == nullptr || free >= std::min(largest, borrowed->slot->size()))) {
    // At least a granule (free room is whole granules), so the staging range is never a packed
    // place among units' places: its removal below unmaps nothing another slot shares.
    const std::size_t bytes =
      std::max(std::min({largest, std::size_t{64} << 20, free}), rt.residency_.model->granule());
    own_slot = rt.memory_.pool->add_slot(bytes);
    // A new slot has had no users.
    const detail::device_pool::mapping m = rt.memory_.pool->map(
      *own_slot, bytes, 0, [](detail::device_pool::slot_id, stream_view) { return std::string(); });
    rt.memory_.pool->wait(m.ready);
    own = m.range;
  }
  TASKSWAP_EXPECTS(own || borrowed != nullptr,
                   message("[comm] initial = \"broadcast\": no room in the ", bytes_text(rt.options_.device.budget),
                           " budget to stage the broadcast; raise [device] budget"));
  const device_span staging = own ? *own : *borrowed->slot;
  if (own) { borrowed = nullptr; }
  // After a failure below an own range is not given back: queued copies may still use it, and
  // the runtime refuses every call after a failed collective anyway.
  rt.swap_->flush_h2d_waits();
  for (detail::unit_record& r : rt.units_) {
    const std::size_t bytes = r.layout.activation ? 0 : state_bytes_of(r.layout);  // an activation block: scratch
    for (std::size_t at = 0; at < bytes; at += staging.size()) {
      const std::size_t piece = std::min(staging.size(), bytes - at);
      const device_span s = staging.subspan(0, piece);
      if (root) { r.stage_in(at, s, rt.streams_.h2d); }
      red.comm().broadcast(s, 0, rt.streams_.h2d, message("the initial replica of '", r.name, "'"));
      if (!root) { r.write_home(at, const_device_span(s), rt.streams_.h2d); }
    }
  }
  rt.wait_streams("the initial broadcast");
  if (own_slot) { rt.memory_.pool->remove_slot(*own_slot); }  // the streams are done with it
  red.comm().check();
  std::vector<std::int64_t> steps(rt.units_.size(), 0);
  for (std::size_t u = 0; u < rt.units_.size(); ++u) { steps[u] = root ? rt.units_[u].step : 0; }
  red.sum(steps, "the first plan: rank 0's step counts");
  for (std::size_t u = 0; u < rt.units_.size(); ++u) { rt.units_[u].step = steps[u]; }
  if (rt.life_.started && rt.guard_) {
    rt.guard_->upload(rt.units_, rt.streams_.h2d);
  }  // the step counts went to the device before they were rank 0's
  if (rt.life_.started) {  // a flush() before the first plan brought the pinned units in already
    for (detail::unit_record& r : rt.units_) {
      if (r.pinned() && (!root || &r == borrowed)) { rt.swap_->fill_slot(r); }
    }
  }
}

}  // namespace

void runtime::impl::sync_replicas()
{
  if (!reduced_ || life_.replicas_synced) { return; }
  if (options_.comm.initial == initial_sync::verify) {
    verify_replicas(reduced_->reduction(), units_);
  } else {
    broadcast_replicas(*this);
  }
  life_.replicas_synced = true;
}

}  // namespace taskswap
