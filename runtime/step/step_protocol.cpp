// SPDX-License-Identifier: Apache-2.0
// The step protocol: acquire, grads_ready, step, release, skip, end_step, flush.

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
  unit_record& r = record(u);
  TASKSWAP_EXPECTS(r.phase() != step_phase::release_deferred && r.phase() != step_phase::updated,
                   message("acquire('", r.name, "'): the unit was ",
                           r.phase() == step_phase::updated
                             ? "updated earlier in this step"
                             : "trained and released earlier in this step and its update has not run yet (it waits "
                               "for its reduction, or with loss scaling or clipping for end_step)",
                           "; a unit is trained once per step and not used after it (accumulate a trained unit's "
                           "micro-batches within one acquisition)"));
  TASKSWAP_EXPECTS(!r.held(), message("acquire('", r.name, "'): the unit is already held; release it first"));
  TASKSWAP_EXPECTS(use == unit_use::frozen || !r.layout.frozen,
                   message("acquire('", r.name,
                           "', train): the unit is registered never trained (trainable = "
                           "false); acquire it with unit_use::frozen, or register it trainable"));
  check_comm();
  start();
  begin_step();
  // After a guarded step the trainer's loss kernel reads the scale that step set.
  if (guard_) { guard_->wait_for_last(s); }
  const bool frozen = use == unit_use::frozen;
  std::optional<detail::planned_acquisition> planned = plan_.peek(u);
  if (planned && (planned->use != detail::planned_use::train) != frozen) {
    // With a communicator the ranks agreed on the planned use; without one the plan is a
    // forecast, and an acquisition it did not foresee is unplanned. Its planned entry is used up
    // all the same, so that prefetch and eviction do not wait for a use that has happened.
    TASKSWAP_EXPECTS(!reducer_, message("acquire('", r.name, "', ", to_string(use), "): step ", ledger_.step(),
                                        " planned it ", frozen ? "trained" : "frozen",
                                        "; with a communicator acquire it as the plan says, or plan it ",
                                        frozen ? "frozen" : "trained"));
    (void)plan_.match(u);
    planned.reset();
  }
  const bool reduced = planned && planned->use == detail::planned_use::frozen_reduced;
  acquire(r, s,
          !frozen   ? phase_move::acquire_train
          : reduced ? phase_move::acquire_frozen_reduced
                    : phase_move::acquire_frozen,
          planned.has_value());
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

void runtime::impl::acquire(unit_record& r, stream_view s, phase_move m, bool as_planned)
{
  const unit_id u{r.index};
  const bool whole = m != phase_move::acquire_frozen;
  const std::optional<detail::planned_acquisition> planned = as_planned ? plan_.match(u) : std::nullopt;
  if (!planned) {
    TASKSWAP_EXPECTS(!reducer_,
                     message("acquire('", r.name, "'): step ", ledger_.step(),
                             " did not plan it. With a communicator every acquisition must be planned "
                             "(runtime::plan), since the ranks agree on each step's units when it is planned"));
    ledger_.unplanned();
  }
  if (r.resident_for(whole)) {
    ledger_.hit();
  } else {
    ledger_.miss();
    if (!swap_->swap_in(r, planned ? planned->position : 0, detail::swap_engine::room_for::acquire, whole)) {
      const std::size_t budget = options_.device.budget;
      const std::size_t needed = charged(r, whole ? r.layout.device_bytes : r.layout.params_bytes);
      throw out_of_memory(
        message("acquire('", r.name, "') needs ", bytes_text(needed), " of device memory", granule_note(), "; ",
                held_count_, " units held now take ", bytes_text(held_bytes()), " and the pinned units ",
                bytes_text(model_->pinned_bytes()), " of the ", bytes_text(model_->capacity()),
                " budget; release units earlier or plan the step so the runtime checks it ahead"),
        needed, pool_->free(), budget);
    }
  }
  swap_->settle(r);  // a swap-in whose slot was being mapped has its copy queued before the wait below
  go(r, m);
  ++held_count_;
  r.held_bytes = r.pinned() ? 0 : charged(r, r.slot->size());
  if (reducer_) { round_.touched(r.index); }
  // The previous use ended on another stream (the trainer's, or aux after an update): wait for it.
  if (r.released_on != nullptr && r.released_on != s.native_handle()) {
    if (!r.released.query()) { r.released.wait(s); }
    r.released_on = nullptr;
  }
  if (!r.arrived.query()) {
    ledger_.wait_timed(r.arrived, s, options_.measure_stall);
  }  // a finished swap-in needs no wait
  if (trace_) { r.trace_span = trace_->open(compute_track(s), r.name, s); }
  prefetch();
}

void runtime::impl::trainer_grads_ready(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = held_record(u, "grads_ready");
  TASKSWAP_EXPECTS(!r.st.frozen_use(), message("grads_ready('", r.name,
                                               "'): the unit is used frozen in this step and has no "
                                               "gradients; plan and acquire it with unit_use::train to train it"));
  if (reducer_) {
    mark_ready(r, s);
    return;
  }
  ensure(r.grads_ready_event, device_).record(s);
}

void runtime::impl::trainer_step(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = held_record(u, "step");
  TASKSWAP_EXPECTS(!r.st.frozen_use(), message("step('", r.name,
                                               "'): the unit is used frozen in this step and is not "
                                               "stepped; plan and acquire it with unit_use::train to train it"));
  switch (path()) {
    case detail::step_path::local: step_local(r, s); return;
    case detail::step_path::local_guarded:
    case detail::step_path::reduced_guarded: step_guarded(r, s); return;
    case detail::step_path::reduced: step_reduced(r, s); return;
  }
}

// Without a communicator, unguarded: the update runs on the trainer's stream now (after the
// gradients' stream, if grads_ready named another).
void runtime::impl::step_local(unit_record& r, stream_view s)
{
  if (r.grads_ready_event && r.grads_ready_event->recorded()) { r.grads_ready_event->wait(s); }
  apply_step(r, s);
  go(r, phase_move::step_local);
}

// Guarded (loss scaling or clipping): the update waits for end_step, where the step's norm and
// scale are known; with a communicator, after the unit's reduction.
void runtime::impl::step_guarded(unit_record& r, stream_view s)
{
  TASKSWAP_EXPECTS(r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced,
                   message("step('", r.name, "'): the unit was stepped already in this step"));
  if (reducer_) { mark_ready(r, s); }  // a step implies the gradients are complete
  defer_update(r, s);
}

// With a communicator, unguarded: the update after the work on `s` and the unit's reduction. On
// `s` when the reduction has ended; else on aux, so that the trainer's stream goes on (the next
// layer's backward) while the reduction runs: now when it is launched, or once it is (on_launched).
void runtime::impl::step_reduced(unit_record& r, stream_view s)
{
  TASKSWAP_EXPECTS(r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced,
                   message("step('", r.name, "'): the unit was stepped already in this step"));
  mark_ready(r, s);  // a step implies the gradients are complete
  const event* reduced = reducer_->reduced(r.index);
  if (reduced != nullptr && reduced->query()) {
    go(r, phase_move::step_now);
    apply_step(r, s);
    return;
  }
  ensure(r.step_point, device_).record(s);
  go(r, phase_move::defer_to_reduction);
  if (reduced != nullptr) { update_on_aux(r); }
}

// The unit's group: the optimizer's settings with its learning-rate scale and weight decay, and
// the same without weight decay for its no-decay tensors.
runtime::impl::update_scalars runtime::impl::scalars_for(const unit_record& r, const adamw_options& optimizer) const
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
  const update_scalars scalars = scalars_for(r, round_.optimizer(options_.optimizer));
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

void runtime::impl::trainer_release(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = held_record(u, "release");
  switch (path()) {
    case detail::step_path::local: release_local(r, s); return;
    case detail::step_path::local_guarded: release_local_guarded(r, s); return;
    case detail::step_path::reduced: release_reduced(r, s); return;
    case detail::step_path::reduced_guarded: release_reduced_guarded(r, s); return;
  }
}

void runtime::impl::zero_grads(unit_record& r, stream_view s)
{
  const detail::unit_layout& l = r.layout;
  fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, s);
}

// Without a communicator, unguarded: a trained use given up without a step leaves zero gradients.
void runtime::impl::release_local(unit_record& r, stream_view s)
{
  if (r.phase() == step_phase::train) { zero_grads(r, s); }
  release(r, s, phase_move::release);
}

// Guarded, without a communicator: a stepped unit's update, then its release, wait for end_step.
void runtime::impl::release_local_guarded(unit_record& r, stream_view s)
{
  if (r.phase() == step_phase::step_deferred) {
    defer_release(r, s);
    return;
  }
  if (r.phase() == step_phase::train) { zero_grads(r, s); }
  release(r, s, phase_move::release);
}

// A trained use released without step() (with a communicator, the runtime steps it); a frozen
// use that other ranks train takes their update at its release by design, and says nothing.
void runtime::impl::warn_unstepped(const unit_record& r)
{
  if (r.phase() != step_phase::train) { return; }
  detail::log_once("release without step", log_level::warning,
                   message("release('", r.name,
                           "'): the unit was not stepped; with a communicator the runtime "
                           "steps it so that every rank applies the same update. Call step() before release()"));
}

// With a communicator every rank applies the same update: a trained use (or a frozen use other
// ranks train) not stepped yet is stepped here.
void runtime::impl::release_reduced(unit_record& r, stream_view s)
{
  // Nothing to reduce: no rank trains it, or this is a forward before its trained use.
  if (r.phase() == step_phase::frozen) {
    release(r, s, phase_move::release);
    return;
  }
  if (r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced) {
    warn_unstepped(r);
    step_reduced(r, s);
  }
  switch (r.phase()) {
    case step_phase::step_deferred: defer_release(r, s); return;  // the release follows the update on aux
    case step_phase::updated_on_aux:
      ensure(r.trainer_released, device_).record(s);
      r.trainer_released->wait(*aux_);
      release(r, *aux_, phase_move::release_after_update);
      return;
    default: release(r, s, phase_move::release_after_update); return;
  }
}

// Guarded, with a communicator: as release_reduced, and the update waits for end_step.
void runtime::impl::release_reduced_guarded(unit_record& r, stream_view s)
{
  if (r.phase() == step_phase::frozen) {
    release(r, s, phase_move::release);
    return;
  }
  if (r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced) {
    warn_unstepped(r);
    step_guarded(r, s);
  }
  defer_release(r, s);
}

void runtime::impl::release(unit_record& r, stream_view s, phase_move m)
{
  const unit_id u{r.index};
  const bool counted = r.phase() != step_phase::release_deferred;  // a deferred release left the count earlier
  r.released.record(s);
  r.released_on = s.native_handle();
  if (trace_) { trace_->close(r.trace_span, s); }
  go(r, m);
  if (counted) { --held_count_; }
  r.held_bytes = 0;
  r.last_release = ++tick_;
  if (r.st.coh == detail::coherence::home_newer) {
    // Upload the new parameters if the unit stays or is needed soon; otherwise free its room.
    const std::uint64_t next = plan_.next_use(u);
    const bool soon =
      next != detail::never && plan_.step_distance(next) <= static_cast<std::size_t>(std::max(r.policy.lookahead, 0));
    if (!r.grads_only() && (r.pinned() || soon)) {
      upload_params(r);
    } else {
      swap_->evict(r);
    }
  }
  prefetch();
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
    const unit_record& r = record(u);
    TASKSWAP_EXPECTS(!r.held() || !plan_.peek(u),
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
    unit_record& r = record(u);
    if (!plan_.peek(u)) { continue; }  // nothing ahead (or named twice)
    if (reducer_) {
      start();
      begin_step();  // the step's reduction begins at its first acquire, or here
      reduced[k] = reducer_->active(r.index) && !reducer_->is_ready(r.index);
    }
    plan_.drop(u, reduced[k]);  // a use to reduce keeps its first entry, for the hold to take
    if (reduced[k]) { hold_for_update(r); }
  }
  prefetch();
  return reduced;
}

std::size_t runtime::impl::held_bytes() const noexcept
{
  std::size_t bytes = 0;
  for (const unit_record& r : units_) {
    if (r.held() && r.phase() != step_phase::release_deferred) { bytes += r.held_bytes; }
  }
  return bytes;
}

step_stats runtime::impl::end_step()
{
  check_comm();
  if (reducer_) {
    begin_step();  // a rank that trained nothing in the step still takes its updates
    if (round_.begun()) { complete_step(); }
  }
  if (held_count_ != 0) {
    for (const unit_record& r : units_) {
      TASKSWAP_EXPECTS(!r.held() || r.st.runtime_holds(),
                       message("end_step: unit '", r.name, "' is still held; release it before the step ends"));
    }
  }
  if (guard_ && round_.any_deferred()) { finish_guarded_step(); }
  if (reducer_ && round_.begun()) {
    reducer_->end();
    ledger_.reduced(reducer_->step_bytes(), reducer_->all_bytes());
    for (const std::uint32_t u : round_.end()) { go(units_[u], phase_move::end_step_reset); }
  }
  plan_.end_step();
  const step_stats done = ledger_.close(pool_->stats().used);
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
  if (homes_.cache) {
    detail::host_cache& cache = *homes_.cache;
    cache.pump();
    plan_.for_each_upcoming(static_cast<std::size_t>(std::max(options_.storage.lookahead, 0)),
                            [&](unit_id u, detail::planned_acquisition a, std::size_t) {
                              const unit_record& r = units_[u.value];
                              const bool served =
                                r.resident_for(a.whole()) && (a.use == detail::planned_use::frozen ||
                                                              r.policy.optimizer != optimizer_placement::host);
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
  if (guard_) { download_guard(); }
  wait_streams("flush");
  if (homes_.cache) { homes_.cache->flush(); }  // the unit files become the disk homes
  if (guard_) { read_guard_steps(); }
  resolve_stalls(true);
  check_comm();
}

}  // namespace taskswap
