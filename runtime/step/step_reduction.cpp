// SPDX-License-Identifier: Apache-2.0
// The step with a communicator: units held for updates other ranks train, readiness, deferred updates.

#include "runtime/runtime_impl.hpp"

#include "kernels/kernels.hpp"

#include <algorithm>

namespace taskswap {

using detail::bytes_text;
using detail::ensure;
using detail::message;
using detail::phase_move;
using detail::step_phase;

// The current step's reduction starts once it is planned: the units this rank only updates are
// acquired on aux with zero gradients, ready for their buckets.
void runtime::impl::begin_step()
{
  if (!reduced_) { return; }
  const detail::agreed_step* step = reduced_->begin(options_.optimizer);
  if (step == nullptr) { return; }
  reduced_->reduction().begin(step->agreement, ledger_.step());
  for (const std::uint32_t u : step->update_only) { hold_for_update(units_[u]); }
}

// A unit this rank updates without training it: it contributes zero gradients and applies the
// reduced ones. With host placement, unless it is resident anyway, only a zeroed gradient slab
// exists on the device: the gradient goes home and the CPU updates it; no parameters travel.
void runtime::impl::hold_for_update(unit_record& r)
{
  // Its state tensors take rank 0's values in its parameter slab: that needs the parameters here.
  if (r.policy.optimizer == optimizer_placement::host && !r.resident() && r.layout.state_tensor_bytes() == 0) {
    hold_gradients_only(r);
  } else {
    acquire(r, *streams_.aux, phase_move::hold_for_update);
    fill_async(r.slot->subspan(r.grads_at(), r.layout.device_grad_bytes()), std::byte{0}, *streams_.aux);
  }
  if (guard_) { guard_->defer(r.index); }  // its update runs with the step's others
  mark_ready(r, *streams_.aux);
}

void runtime::impl::hold_gradients_only(unit_record& r)
{
  const std::optional<detail::planned_acquisition> planned = residency_.plan.match(unit_id{r.index});
  const std::size_t bytes = r.layout.device_grad_bytes();
  if (!swap_->swap_in_grads(r, planned ? planned->position : 0, *streams_.aux)) {
    throw out_of_memory(
      message("step ", ledger_.step(), ": the zeroed gradient slab of '", r.name, "' (",
              bytes_text(residency_.model->charged(r.index, bytes)), "), which other ranks train, does not fit in the ",
              bytes_text(options_.device.budget), " budget beside the units held; raise [device] budget"),
      bytes, memory_.pool->free(), options_.device.budget);
  }
  go(r, phase_move::hold_for_update);
  units_.count_hold();
  r.held_bytes = residency_.model->charged(r.index, bytes);
  reduced_->touched(r.index);
}

void runtime::impl::mark_ready(unit_record& r, stream_view s)
{
  if (reduced_->reduction().is_ready(r.index)) { return; }  // the reduction waits for the first ready point
  ensure(r.grads_ready_event, device_).record(s);
  // One contiguous range: the trainable tensors and the gaps between them; the slab's tail padding
  // and the state tensors' gradient elements are not sent. The state tensors are broadcast.
  const detail::unit_layout& l = r.layout;
  const device_span state =
    l.state_tensor_bytes() == 0 ? device_span{} : r.slot->subspan(l.state_at(), l.state_tensor_bytes());
  on_launched(
    reduced_->reduction().ready(r.index, r.slot->subspan(r.grads_at(), l.reduce_bytes()), *r.grads_ready_event, state));
}

void runtime::impl::on_launched(const std::vector<std::uint32_t>& units)
{
  if (guard_) { return; }  // a guarded step updates its units together at end_step
  for (const std::uint32_t u : units) {
    unit_record& r = units_[u];
    const step_phase p = r.phase();
    if (p == step_phase::update_only || p == step_phase::step_deferred || p == step_phase::release_deferred) {
      update_on_aux(r);
    }
  }
}

// The update of a unit whose reduction was launched after the trainer's step() (or that only
// this runtime holds): on aux, after the trainer's stream reached step() and the reduction.
void runtime::impl::update_on_aux(unit_record& r)
{
  stream& aux = *streams_.aux;
  const step_phase p = r.phase();
  if (p != step_phase::update_only && !r.step_point->query()) { r.step_point->wait(aux); }
  const event* reduced = reduced_->reduction().reduced(r.index);
  if (!reduced->query()) { reduced->wait(aux); }
  apply_step(r, aux);
  if (p == step_phase::step_deferred) {  // the trainer still holds it
    go(r, phase_move::update_on_aux);
    return;
  }
  if (p == step_phase::release_deferred && !r.trainer_released->query()) { r.trainer_released->wait(aux); }
  release(r, aux, phase_move::update_and_release);
}

// Units planned here but never acquired still count as trained by this rank: they contribute
// zeros and take the update, as units only other ranks trained do.
void runtime::impl::complete_step()
{
  for (const std::uint32_t u : reduced_->reduction().not_ready()) {
    unit_record& r = units_[u];
    if (r.held()) { continue; }  // the trainer still holds it: end_step reports that
    hold_for_update(r);
  }
}

}  // namespace taskswap
