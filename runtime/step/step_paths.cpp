// SPDX-License-Identifier: Apache-2.0
// step() and release() on each step path (Note [Unit states]): without or with a communicator,
// unguarded or guarded.

#include "runtime/runtime_impl.hpp"

#include "device/log.hpp"
#include "kernels/kernels.hpp"

namespace taskswap {

using detail::ensure;
using detail::message;
using detail::phase_move;
using detail::step_phase;
using unit_record = detail::unit_record;

namespace {

// Without a communicator, unguarded: the update runs on the trainer's stream now (after the
// gradients' stream, if grads_ready named another).
void step_local(runtime::impl& rt, unit_record& r, stream_view s)
{
  if (r.grads_ready_event && r.grads_ready_event->recorded()) { r.grads_ready_event->wait(s); }
  rt.apply_step(r, s);
  rt.go(r, phase_move::step_local);
}

// Guarded (loss scaling or clipping): the update waits for end_step, where the step's norm and
// scale are known; with a communicator, after the unit's reduction.
void step_guarded(runtime::impl& rt, unit_record& r, stream_view s)
{
  TASKSWAP_EXPECTS(r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced,
                   message("step('", r.name, "'): the unit was stepped already in this step"));
  if (rt.reduced_) { rt.mark_ready(r, s); }  // a step implies the gradients are complete
  rt.defer_update(r, s);
}

// With a communicator, unguarded: the update after the work on `s` and the unit's reduction. On
// `s` when the reduction has ended; else on aux, so that the trainer's stream goes on (the next
// layer's backward) while the reduction runs: now when it is launched, or once it is (on_launched).
void step_reduced(runtime::impl& rt, unit_record& r, stream_view s)
{
  TASKSWAP_EXPECTS(r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced,
                   message("step('", r.name, "'): the unit was stepped already in this step"));
  rt.mark_ready(r, s);  // a step implies the gradients are complete
  const event* reduced = rt.reduced_->reduction().reduced(r.index);
  if (reduced != nullptr && reduced->query()) {
    rt.go(r, phase_move::step_now);
    rt.apply_step(r, s);
    return;
  }
  ensure(r.step_point, rt.device_).record(s);
  rt.go(r, phase_move::defer_to_reduction);
  if (reduced != nullptr) { rt.update_on_aux(r); }
}

void zero_grads(unit_record& r, stream_view s)
{
  const detail::unit_layout& l = r.layout;
  fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, s);
}

// Without a communicator, unguarded: a trained use given up without a step leaves zero gradients.
void release_local(runtime::impl& rt, unit_record& r, stream_view s)
{
  if (r.phase() == step_phase::train) { zero_grads(r, s); }
  rt.release(r, s, phase_move::release);
}

// Guarded, without a communicator: a stepped unit's update, then its release, wait for end_step.
void release_local_guarded(runtime::impl& rt, unit_record& r, stream_view s)
{
  if (r.phase() == step_phase::step_deferred) {
    rt.defer_release(r, s);
    return;
  }
  if (r.phase() == step_phase::train) { zero_grads(r, s); }
  rt.release(r, s, phase_move::release);
}

// A trained use released without step() (with a communicator, the runtime steps it); a frozen
// use that other ranks train takes their update at its release by design, and says nothing.
void warn_unstepped(const unit_record& r)
{
  if (r.phase() != step_phase::train) { return; }
  detail::log_once("release without step", log_level::warning,
                   message("release('", r.name,
                           "'): the unit was not stepped; with a communicator the runtime "
                           "steps it so that every rank applies the same update. Call step() before release()"));
}

// With a communicator every rank applies the same update: a trained use (or a frozen use other
// ranks train) not stepped yet is stepped here.
void release_reduced(runtime::impl& rt, unit_record& r, stream_view s)
{
  // Nothing to reduce: no rank trains it, or this is a forward before its trained use.
  if (r.phase() == step_phase::frozen) {
    rt.release(r, s, phase_move::release);
    return;
  }
  if (r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced) {
    warn_unstepped(r);
    step_reduced(rt, r, s);
  }
  switch (r.phase()) {
    case step_phase::step_deferred: rt.defer_release(r, s); return;  // the release follows the update on aux
    case step_phase::updated_on_aux:
      ensure(r.trainer_released, rt.device_).record(s);
      r.trainer_released->wait(*rt.streams_.aux);
      rt.release(r, *rt.streams_.aux, phase_move::release_after_update);
      return;
    default: rt.release(r, s, phase_move::release_after_update); return;
  }
}

// Guarded, with a communicator: as release_reduced, and the update waits for end_step.
void release_reduced_guarded(runtime::impl& rt, unit_record& r, stream_view s)
{
  if (r.phase() == step_phase::frozen) {
    rt.release(r, s, phase_move::release);
    return;
  }
  if (r.phase() == step_phase::train || r.phase() == step_phase::frozen_reduced) {
    warn_unstepped(r);
    step_guarded(rt, r, s);
  }
  rt.defer_release(r, s);
}

}  // namespace

void runtime::impl::trainer_step(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = units_.held_by_trainer(u, "step");
  TASKSWAP_EXPECTS(!r.st.frozen_use(), message("step('", r.name,
                                               "'): the unit is used frozen in this step and is not "
                                               "stepped; plan and acquire it with unit_use::train to train it"));
  switch (path()) {
    case detail::step_path::local: step_local(*this, r, s); return;
    case detail::step_path::local_guarded:
    case detail::step_path::reduced_guarded: step_guarded(*this, r, s); return;
    case detail::step_path::reduced: step_reduced(*this, r, s); return;
  }
}

void runtime::impl::trainer_release(unit_id u, stream_view s)
{
  check_comm();
  unit_record& r = units_.held_by_trainer(u, "release");
  switch (path()) {
    case detail::step_path::local: release_local(*this, r, s); return;
    case detail::step_path::local_guarded: release_local_guarded(*this, r, s); return;
    case detail::step_path::reduced: release_reduced(*this, r, s); return;
    case detail::step_path::reduced_guarded: release_reduced_guarded(*this, r, s); return;
  }
}

}  // namespace taskswap
