// SPDX-License-Identifier: Apache-2.0
// The step protocol: acquire, grads_ready, step, release, end_step, flush.

#include "runtime/runtime_impl.hpp"

#include "device/log.hpp"
#include "kernels/kernels.hpp"

#include <algorithm>

namespace taskswap {

using detail::bytes_text;
using detail::ensure;
using detail::message;

unit_view runtime::impl::trainer_acquire(unit_id u, stream_view s, unit_use use)
{
  unit_record& r = record(u);
  TASKSWAP_EXPECTS(!r.release_deferred,
                   message("acquire('", r.name,
                           "'): the unit was trained and released earlier in this step and its "
                           "update has not run yet (it waits for its reduction, or with loss scaling or clipping for "
                           "end_step); acquire a trained unit once per step (accumulate its micro-batches within one "
                           "acquisition)"));
  TASKSWAP_EXPECTS(!r.held, message("acquire('", r.name, "'): the unit is already held; release it first"));
  TASKSWAP_EXPECTS(use == unit_use::frozen || !r.layout.frozen,
                   message("acquire('", r.name,
                           "', train): the unit is registered never trained (trainable = "
                           "false); acquire it with unit_use::frozen, or register it trainable"));
  check_comm();
  start();
  begin_step();
  // After a guarded step the trainer's loss kernel reads the scale that step set.
  if (guard_ && guard_->wait_done && !guard_->done.query()) { guard_->done.wait(s); }
  const bool frozen = use == unit_use::frozen;
  std::optional<detail::planned_acquisition> planned = plan_.peek(u);
  if (planned && (planned->use != detail::planned_use::train) != frozen) {
    // With a communicator the ranks agreed on the planned use; without one the plan is a
    // forecast, and an acquisition it did not foresee is unplanned. Its planned entry is used up
    // all the same, so that prefetch and eviction do not wait for a use that has happened.
    TASKSWAP_EXPECTS(!reducer_, message("acquire('", r.name, "', ", to_string(use), "): step ", steps_done_,
                                        " planned it ", frozen ? "trained" : "frozen",
                                        "; with a communicator acquire it as the plan says, or plan it ",
                                        frozen ? "frozen" : "trained"));
    (void)plan_.match(u);
    planned.reset();
  }
  const bool reduced = planned && planned->use == detail::planned_use::frozen_reduced;
  acquire(r, s, !frozen || reduced, planned.has_value());
  r.frozen = frozen;
  r.frozen_reduced = reduced;
  const detail::unit_layout& l = r.layout;
  unit_view v;
  v.id = u;
  v.tensors = l.tensors;
  v.params = {r.slot->data() + l.params, l.compute, l.count};
  v.owner = &device_.backend();
  if (frozen) {
    ++current_.frozen;
    v.grads = {nullptr, l.grad, 0};
    v.frozen = true;
    // Other ranks train it: its gradients stay zero, so it is ready for the reduction at once
    // (unless rank 0's state tensors would arrive while the forward pass reads them: at release).
    if (r.frozen_reduced && r.layout.state_tensor_bytes() == 0) { mark_ready(r, s); }
  } else {
    v.grads = {r.slot->data() + l.device_grads, l.grad, l.count};
  }
  return v;
}

void runtime::impl::acquire(unit_record& r, stream_view s, bool whole, bool as_planned)
{
  const unit_id u{r.index};
  r.stepped = false;
  const std::optional<detail::planned_acquisition> planned = as_planned ? plan_.match(u) : std::nullopt;
  if (!planned) {
    TASKSWAP_EXPECTS(!reducer_,
                     message("acquire('", r.name, "'): step ", steps_done_,
                             " did not plan it. With a communicator every acquisition must be planned "
                             "(runtime::plan), since the ranks agree on each step's units when it is planned"));
    ++current_.unplanned;
  }
  if (r.resident_for(whole)) {
    ++current_.hits;
  } else {
    ++current_.misses;
    if (!swap_in(r, planned ? planned->position : 0, true, whole)) {
      const std::size_t budget = options_.device.budget;
      const std::size_t needed = charged(r, whole ? r.layout.device_bytes : r.layout.params_bytes);
      throw out_of_memory(
        message("acquire('", r.name, "') needs ", bytes_text(needed), " of device memory", granule_note(), "; ",
                held_count_, " units held now take ", bytes_text(held_bytes_), " and the pinned units ",
                bytes_text(model_->pinned_bytes()), " of the ", bytes_text(model_->capacity()),
                " budget; release units earlier or plan the step so the runtime checks it ahead"),
        needed, pool_->free(), budget);
    }
  }
  r.held = true;
  ++held_count_;
  r.held_bytes = r.pinned() ? 0 : charged(r, r.slot->size());
  held_bytes_ += r.held_bytes;
  if (reducer_) { step_units_.push_back(r.index); }
  // The previous use ended on another stream (the trainer's, or aux after an update): wait for it.
  if (r.released_on != nullptr && r.released_on != s.native_handle()) {
    if (!r.released.query()) { r.released.wait(s); }
    r.released_on = nullptr;
  }
  const bool pending = !r.arrived.query();  // a finished swap-in needs no wait enqueued
  if (pending && options_.measure_stall) {
    if (stalls_free_.empty()) {
      stalls_free_.push_back({event(device_, {.timing = true}), event(device_, {.timing = true}), 0});
    }
    stall_timer t = std::move(stalls_free_.back());
    stalls_free_.pop_back();
    t.step = steps_done_;
    t.begin.record(s);
    r.arrived.wait(s);
    t.end.record(s);
    stalls_pending_.push_back(std::move(t));
  } else if (pending) {
    r.arrived.wait(s);
  }
  if (trace_) { r.trace_span = trace_->open(compute_track(s), r.name, s); }
  prefetch();
}

void runtime::impl::trainer_grads_ready(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = held_record(u, "grads_ready");
  TASKSWAP_EXPECTS(!r.frozen, message("grads_ready('", r.name,
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
  TASKSWAP_EXPECTS(!r.frozen, message("step('", r.name,
                                      "'): the unit is used frozen in this step and is not "
                                      "stepped; plan and acquire it with unit_use::train to train it"));
  if (!reducer_) {
    if (guard_) {
      TASKSWAP_EXPECTS(!r.step_requested, message("step('", r.name, "'): the unit was stepped already in this step"));
      defer_update(r, s);
      return;
    }
    if (r.grads_ready_event && r.grads_ready_event->recorded()) { r.grads_ready_event->wait(s); }
    apply_step(r, s);
    r.stepped = true;
    return;
  }
  TASKSWAP_EXPECTS(!r.step_requested, message("step('", r.name, "'): the unit was stepped already in this step"));
  request_step(r, s);
}

// With a communicator: the update of `r` after the work on `s` and its reduction; on `s` when the
// reduction was launched, else on aux once it is.
void runtime::impl::request_step(unit_record& r, stream_view s)
{
  mark_ready(r, s);  // a step implies the gradients are complete
  if (guard_) {
    defer_update(r, s);
    return;
  }
  r.step_requested = true;
  if (const event* reduced = reducer_->reduced(r.index)) {
    if (!reduced->query()) { reduced->wait(s); }
    apply_step(r, s);
    return;
  }
  // Its bucket waits for units not ready yet: the update runs on aux once it is launched.
  ensure(r.step_point, device_).record(s);
  r.step_deferred = true;
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
  const update_scalars scalars = scalars_for(r, reducer_ && step_begun_ ? step_optimizer_ : options_.optimizer);
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
  r.dirty = true;
}

void runtime::impl::trainer_release(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = held_record(u, "release");
  if (!reducer_ || (r.frozen && !r.frozen_reduced)) {  // a frozen use no rank trains: nothing to reduce
    if (r.step_deferred) {  // a guarded step: the update, then the release, at end_step
      defer_release(r, s);
      return;
    }
    if (!r.frozen && !r.stepped) {  // given up without a step: its gradients are zero again for the next use
      const detail::unit_layout& l = r.layout;
      fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, s);
    }
    release(r, s);
    return;
  }
  TASKSWAP_EXPECTS(!r.release_deferred, message("release('", r.name, "'): the unit was released already"));
  if (!r.step_requested) {
    if (!r.frozen_reduced) {  // a frozen use that others train takes their update here, by design
      detail::log_once("release without step", log_level::warning,
                       message("release('", r.name,
                               "'): the unit was not stepped; with a communicator the runtime "
                               "steps it so that every rank applies the same update. Call step() before release()"));
    }
    request_step(r, s);
  }
  if (r.step_deferred) {  // the update has not run yet; the release follows it
    ensure(r.trainer_released, device_).record(s);
    r.release_deferred = true;
    --held_count_;  // the trainer no longer holds it; the runtime does until the update ran
    held_bytes_ -= r.held_bytes;
    return;
  }
  if (r.updated_on_aux) {
    ensure(r.trainer_released, device_).record(s);
    r.trainer_released->wait(*aux_);
    release(r, *aux_);
    return;
  }
  release(r, s);
}

void runtime::impl::release(unit_record& r, stream_view s)
{
  const unit_id u{r.index};
  r.released.record(s);
  r.released_on = s.native_handle();
  if (trace_) { trace_->close(r.trace_span, s); }
  r.held = false;
  r.frozen = false;
  r.frozen_reduced = false;
  if (!r.release_deferred) {  // a deferred release left the trainer's count when the trainer called it
    --held_count_;
    held_bytes_ -= r.held_bytes;
  }
  r.held_bytes = 0;
  r.release_deferred = false;
  r.last_release = ++tick_;
  if (r.params_stale) {
    // Upload the new parameters if the unit stays or is needed soon; otherwise free its room.
    const std::uint64_t next = plan_.next_use(u);
    const bool soon =
      next != detail::never && plan_.step_distance(next) <= static_cast<std::size_t>(std::max(r.policy.lookahead, 0));
    if (!r.grads_only && (r.pinned() || soon)) {
      upload_params(r);
    } else {
      evict(r);
    }
  }
  prefetch();
}

step_stats runtime::impl::end_step()
{
  check_comm();
  if (reducer_) {
    begin_step();  // a rank that trained nothing in the step still takes its updates
    if (step_begun_) { complete_step(); }
  }
  if (held_count_ != 0) {
    for (const unit_record& r : units_) {
      TASKSWAP_EXPECTS(!r.held || r.release_deferred || r.update_only,
                       message("end_step: unit '", r.name, "' is still held; release it before the step ends"));
    }
  }
  if (guard_ && !guard_units_.empty()) { finish_guarded_step(); }
  if (reducer_ && step_begun_) {
    reducer_->end();
    current_.reduced_bytes = reducer_->step_bytes();
    current_.reduce_all_bytes = reducer_->all_bytes();
    agreed_.pop_front();
    step_begun_ = false;
    for (const std::uint32_t u : step_units_) { reset_step_flags(units_[u]); }
    step_units_.clear();
  }
  plan_.end_step();
  const step_stats done = close_step_stats();
  prefetch();
  return done;
}

void runtime::impl::flush()
{
  // Units the runtime holds for the next step's updates (with a communicator) are no obstacle.
  for (const unit_record& r : units_) {
    TASKSWAP_EXPECTS(!r.held || r.update_only, message("flush: unit '", r.name, "' is held; release it first"));
  }
  start();
  for (unit_record& r : units_) {
    if (r.resident() && r.dirty) { write_back(r); }
  }
  if (guard_) { download_guard(); }
  wait_streams("flush");
  if (guard_) { read_guard_steps(); }
  resolve_stalls(true);
  check_comm();
}

}  // namespace taskswap
