// SPDX-License-Identifier: Apache-2.0
// The step protocol: acquire, grads_ready, the unit's update, its release, skip, end_step, flush.

#include "runtime/runtime_impl.hpp"

#include "device/log.hpp"
#include "kernels/kernels.hpp"

#include <algorithm>
#include <numeric>

namespace taskswap {

using detail::bytes_text;
using detail::coherence_move;
using detail::ensure;
using detail::message;
using detail::phase_move;
using detail::step_phase;

unit_view runtime::impl::trainer_acquire(unit_id u, stream_view s, unit_use use)
{
  unit_record& r = units_.at(u);
  TASKSWAP_EXPECTS(r.phase() != step_phase::release_deferred && r.phase() != step_phase::updated,
                   message("acquire('", r.name, "'): the unit was ",
                           r.phase() == step_phase::updated
                             ? "updated earlier in this step"
                             : "trained and released earlier in this step and its update has not run yet (it waits "
                               "for its reduction, or with loss scaling or clipping for end_step)",
                           "; a unit is trained once per step and not used after it (accumulate a trained unit's "
                           "micro-batches within one acquisition)"));
  TASKSWAP_EXPECTS(!r.held(), message("acquire('", r.name, "'): the unit is already held; release it first"));
  TASKSWAP_EXPECTS(use != unit_use::train || !r.layout.frozen,
                   message("acquire('", r.name, "', train): the unit is registered never trained (trainable = false",
                           r.layout.activation ? ", an activation block" : "", "); acquire it with unit_use::",
                           r.layout.activation ? "stash or unit_use::frozen" : "frozen, or register it trainable"));
  TASKSWAP_EXPECTS(use != unit_use::stash || r.layout.activation,
                   message("acquire('", r.name,
                           "', stash): the unit is not an activation block; register it with activation = true, "
                           "or acquire it trained or frozen"));
  check_comm();
  start();
  begin_step();
  // After a guarded step the trainer's loss kernel reads the scale that step set.
  if (guard_) { guard_->wait_for_last(s); }
  const bool frozen = use != unit_use::train;  // a stash is a frozen use that writes the slab
  const bool stash = use == unit_use::stash;
  std::optional<detail::planned_acquisition> planned = residency_.plan.peek(u);
  if (planned && ((planned->use != detail::planned_use::train) != frozen ||
                  (planned->use == detail::planned_use::stash) != stash)) {
    // With a communicator the ranks agreed on the planned use; without one the plan is a
    // forecast, and an acquisition it did not foresee is unplanned. Its planned entry is used up
    // all the same, so that prefetch and eviction do not wait for a use that has happened.
    const std::string_view planned_as = planned->use == detail::planned_use::train   ? "trained"
                                        : planned->use == detail::planned_use::stash ? "stash"
                                                                                     : "frozen";
    TASKSWAP_EXPECTS(
      !reduced_, message("acquire('", r.name, "', ", to_string(use), "): step ", ledger_.step(), " planned it ",
                         planned_as, "; with a communicator acquire it as the plan says, or plan it ", to_string(use)));
    (void)residency_.plan.match(u);
    planned.reset();
  }
  const bool reduced = planned && planned->use == detail::planned_use::frozen_reduced;
  acquire(r, s,
          !frozen   ? phase_move::acquire_train
          : reduced ? phase_move::acquire_frozen_reduced
                    : phase_move::acquire_frozen,
          planned.has_value(), stash);
  const detail::unit_layout& l = r.layout;
  unit_view v;
  v.id = u;
  v.tensors = l.tensors;
  v.params = {r.slot->data() + l.params, l.compute, l.count};
  v.owner = &device_.backend();
  if (frozen) {
    ledger_.frozen_use();
    v.grads = {nullptr, l.grad, 0};
    v.frozen = true;
    // Other ranks train it: its gradients stay zero, so it is ready for the reduction at once
    // (unless rank 0's state tensors would arrive while the forward pass reads them: at release).
    if (reduced && r.layout.state_tensor_bytes() == 0) { mark_ready(r, s); }
  } else {
    v.grads = {r.slot->data() + l.device_grads, l.grad, l.count};
  }
  return v;
}

void runtime::impl::acquire(unit_record& r, stream_view s, phase_move m, bool as_planned, bool stash)
{
  const unit_id u{r.index};
  const bool whole = m != phase_move::acquire_frozen;
  const std::optional<detail::planned_acquisition> planned = as_planned ? residency_.plan.match(u) : std::nullopt;
  if (!planned) {
    TASKSWAP_EXPECTS(!reduced_,
                     message("acquire('", r.name, "'): step ", ledger_.step(),
                             " did not plan it. With a communicator every acquisition must be planned "
                             "(runtime::plan), since the ranks agree on each step's units when it is planned"));
    ledger_.unplanned();
  }
  // A block mapped for a stash not made holds nothing to read: a read brings the home in.
  if (r.resident_for(whole) && (stash || !r.unwritten)) {
    if (!stash) { ledger_.hit(); }
  } else {
    if (!stash) { ledger_.miss(); }  // a stash copies nothing in
    const std::uint64_t at = planned ? planned->position : 0;
    if (!swap_->swap_in(r, at, detail::swap_engine::room_for::acquire, whole, !stash)) {
      const std::size_t budget = options_.device.budget;
      const std::size_t needed =
        residency_.model->charged(r.index, whole ? r.layout.device_bytes : r.layout.params_bytes);
      throw out_of_memory(
        message("acquire('", r.name, "') needs ", bytes_text(needed), " of device memory",
                residency_.model->granule_note(), "; ", units_.held(), " units held now take ",
                bytes_text(units_.held_bytes()), " and the pinned units ", bytes_text(residency_.model->pinned_bytes()),
                " of the ", bytes_text(residency_.model->capacity()),
                " budget; release units earlier or plan the step so the runtime checks it ahead"),
        needed, memory_.pool->free(), budget);
    }
  }
  swap_->settle(r);  // a swap-in whose slot was being mapped has its copy queued before the wait below
  go(r, m);
  units_.count_hold();
  r.held_bytes = r.pinned() ? 0 : residency_.model->charged(r.index, r.slot->size());
  if (reduced_) { reduced_->touched(r.index); }
  // The previous use ended on another stream (the trainer's, or aux after an update): wait for it.
  if (r.released_on != nullptr && r.released_on != s.native_handle()) {
    if (!r.released.query()) { r.released.wait(s); }
    r.released_on = nullptr;
  }
  if (stash) {
    // The last stash's copy home may still read the slot the trainer writes now; a slot mapped
    // for it is ready once h2d has passed its memory's earlier users (its `arrived`).
    if (r.written_back && !r.written_back->query()) { r.written_back->wait(s); }
    if (!r.arrived.query()) { r.arrived.wait(s); }
    r.unwritten = false;
    if (!r.pinned()) { go(r, coherence_move::stash); }
  } else if (!r.arrived.query()) {
    ledger_.wait_timed(r.arrived, s, options_.measure_stall);
  }  // a finished swap-in needs no wait
  if (trace_.recorder) { r.trace_span = trace_.recorder->open(compute_track(s), r.name, s); }
  prefetch();
}

void runtime::impl::trainer_grads_ready(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = units_.held_by_trainer(u, "grads_ready");
  TASKSWAP_EXPECTS(!r.st.frozen_use(), message("grads_ready('", r.name,
                                               "'): the unit is used frozen in this step and has no "
                                               "gradients; plan and acquire it with unit_use::train to train it"));
  if (reduced_) {
    mark_ready(r, s);
    return;
  }
  ensure(r.grads_ready_event, device_).record(s);
}

void runtime::impl::check_comm() const
{
  if (reduced_) { reduced_->reduction().comm().check(); }
}

const adamw_options& runtime::impl::step_optimizer() const noexcept
{
  return reduced_ ? reduced_->optimizer(options_.optimizer) : options_.optimizer;
}

// The unit's group: the optimizer's settings with its learning-rate scale and weight decay, and
// the same without weight decay for its no-decay tensors.
detail::update_scalars runtime::impl::scalars_for(const unit_record& r, const adamw_options& optimizer) const
{
  adamw_options o = optimizer;
  o.lr *= r.policy.lr_scale;
  if (r.policy.weight_decay) { o.weight_decay = *r.policy.weight_decay; }
  adamw_options plain = o;
  plain.weight_decay = 0;
  return {detail::make_adamw_scalars(o, r.step), detail::make_adamw_scalars(plain, r.step)};
}

void runtime::impl::apply_step(unit_record& r, stream_view s)
{
  ++r.step;
  // With a communicator every update of a step uses the settings the step began with, whichever
  // rank's call order enqueues it: replicas stay identical when set_optimizer changes them.
  const detail::update_scalars scalars = scalars_for(r, step_optimizer());
  if (r.policy.optimizer == optimizer_placement::host) {
    host_step(r, scalars, s);
    return;
  }
  const detail::unit_layout& l = r.layout;
  const detail::adamw_slabs whole = l.slabs_at(r.slot->data(), l.device_grads);
  for (const detail::adamw_run& run : l.runs) {
    detail::adamw_async(l.run_slabs(whole, run), run.decay ? scalars.decay : scalars.no_decay, s);
  }
  fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, s);
  go(r, coherence_move::step_on_device);
}

void runtime::impl::release(unit_record& r, stream_view s, phase_move m)
{
  const unit_id u{r.index};
  const bool counted = r.phase() != step_phase::release_deferred;  // a deferred release left the count earlier
  r.released.record(s);
  r.released_on = s.native_handle();
  if (trace_.recorder) { trace_.recorder->close(r.trace_span, s); }
  go(r, m);
  if (counted) { units_.count_let_go(); }
  r.held_bytes = 0;
  units_.stamp_release(r);
  if (r.st.coh == detail::coherence::home_newer) {
    // Upload the new parameters if the unit stays or is needed soon; otherwise free its room.
    const std::uint64_t next = residency_.plan.next_use(u);
    const bool soon = next != detail::never &&
                      residency_.plan.step_distance(next) <= static_cast<std::size_t>(std::max(r.policy.lookahead, 0));
    if (!r.grads_only() && (r.pinned() || soon)) {
      upload_params(r);
    } else {
      swap_->evict(r);
    }
  }
  if (r.layout.activation && !r.pinned()) { release_activation(r); }
  prefetch();
}

// An activation block: a stash goes home now, after the work on the release's stream, so that
// its room can be taken; after its last read (no frozen use planned next) its room is freed.
void runtime::impl::release_activation(unit_record& r)
{
  if (r.dirty()) {
    swap_->write_back(r);
    return;
  }
  const std::uint64_t next = residency_.plan.next_use(unit_id{r.index});
  if (next == detail::never || residency_.plan.use_at(next) != detail::planned_use::frozen) { swap_->evict(r); }
}

// An early exit: the trainer will not make these units' planned acquisitions still ahead in this
// step. Without a communicator they are dropped. With one the ranks agreed on them: a use to
// reduce (the unit trained in the step, here or on another rank) is completed now, as
// complete_step() would at end_step (zero gradients from this rank, the update), and the rest are
// dropped, before the hold, so that its release sees the unit's next use where it really is.
std::vector<bool> runtime::impl::trainer_skip(std::span<const unit_id> units)
{
  check_comm();
  for (const unit_id u : units) {  // all checked before any is changed
    const unit_record& r = units_.at(u);
    TASKSWAP_EXPECTS(!r.held() || !residency_.plan.peek(u),
                     message("skip('", r.name,
                             "'): the unit is held; release it first (skip drops the acquisitions of it still ahead "
                             "in the step)"));
  }
  // Held for their update in reduction order (highest id first): each bucket launches as soon as
  // it can, so a held unit gives its room back before the next is held where the buckets allow.
  std::vector<std::size_t> by_order(units.size());
  std::iota(by_order.begin(), by_order.end(), std::size_t{0});
  std::stable_sort(by_order.begin(), by_order.end(),
                   [&](std::size_t a, std::size_t b) { return units[a].value > units[b].value; });
  std::vector<bool> reduced(units.size(), false);
  for (const std::size_t k : by_order) {
    const unit_id u = units[k];
    unit_record& r = units_.at(u);
    if (!residency_.plan.peek(u)) { continue; }  // nothing ahead (or named twice)
    if (reduced_) {
      start();
      begin_step();  // the step's reduction begins at its first acquire, or here
      reduced[k] = reduced_->reduction().active(r.index) && !reduced_->reduction().is_ready(r.index);
    }
    residency_.plan.drop(u, reduced[k]);  // a use to reduce keeps its first entry, for the hold to take
    if (reduced[k]) { hold_for_update(r); }
  }
  prefetch();
  return reduced;
}

step_stats runtime::impl::end_step()
{
  check_comm();
  if (reduced_) {
    begin_step();  // a rank that trained nothing in the step still takes its updates
    if (reduced_->begun()) { complete_step(); }
  }
  if (units_.held() != 0) {
    for (const unit_record& r : units_) {
      TASKSWAP_EXPECTS(!r.held() || r.st.runtime_holds(),
                       message("end_step: unit '", r.name, "' is still held; release it before the step ends"));
    }
  }
  if (guard_ && guard_->any_deferred()) { finish_guarded_step(); }
  if (reduced_ && reduced_->begun()) {
    reduced_->reduction().end();
    ledger_.reduced(reduced_->reduction().step_bytes(), reduced_->reduction().all_bytes());
    for (const std::uint32_t u : reduced_->end()) { go(units_[u], phase_move::end_step_reset); }
  }
  residency_.plan.end_step();
  const step_stats done = ledger_.close(memory_.pool->stats().used);
  prefetch();
  return done;
}

// Note [Two hops]: disk homes come into the host cache up to [storage] lookahead steps ahead, in
// the order of their use, as far as there is room that costs nothing (Note [Host cache]); the
// device prefetch then takes a unit only once its home is there (unit_record::home_ready), so
// neither hop makes the trainer thread wait for the drive where the cache has the room. A unit whose device
// copy serves the whole use is not read: a frozen use, or one whose update runs on the device,
// does not need the home (and after such an update the home is older than the copy). A host
// placement's update does: its gradients come home and the CPU AdamW steps the home there.
void runtime::impl::prefetch()
{
  if (memory_.homes.cache) {
    detail::host_cache& cache = *memory_.homes.cache;
    cache.pump();
    residency_.plan.for_each_upcoming(
      static_cast<std::size_t>(std::max(options_.storage.lookahead, 0)),
      [&](unit_id u, detail::planned_acquisition a, std::size_t) {
        const unit_record& r = units_[u.value];
        const bool served = r.resident_for(a.whole()) &&
                            (a.use == detail::planned_use::frozen || r.policy.optimizer != optimizer_placement::host);
        return r.home.cache == nullptr || served || cache.prefetch(r.home.entry);
      });
  }
  swap_->prefetch();
}

void runtime::impl::flush()
{
  // Units the runtime holds for the next step's updates (with a communicator) are no obstacle.
  for (const unit_record& r : units_) {
    TASKSWAP_EXPECTS(!r.held() || r.phase() == step_phase::update_only,
                     message("flush: unit '", r.name, "' is held; release it first"));
  }
  start();
  swap_->settle_all();
  for (unit_record& r : units_) {
    if (r.dirty()) { swap_->write_back(r); }
  }
  if (guard_ && life_.started) { guard_->download(streams_.d2h); }
  wait_streams("flush");
  if (memory_.homes.cache) { memory_.homes.cache->flush(); }  // the unit files become the disk homes
  if (guard_) { guard_->read_steps(units_); }
  ledger_.resolve_stalls(true, options_.timeout);
  check_comm();
}

}  // namespace taskswap
