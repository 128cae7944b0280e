// SPDX-License-Identifier: Apache-2.0
// Guarded steps: dynamic loss scaling and global-norm clipping over every unit a step trains.
//
// Clipping needs the norm of all of a step's gradients, and a skipped step skips every unit, so
// no unit may be updated before every gradient of the step is known. In a guarded step, step()
// and release() of a trained unit only record where the trainer's stream is; the unit keeps its
// room (the plan check counts it to the step's end) and end_step() enqueues, on the aux stream:
//   1. for each unit of the step, in unit order, after its step point (and its reduction): the
//      square sum of its unscaled gradients, added to the step's sum (host/step_guard.hpp);
//   2. one thread finishes the step: the norm, the clipping coefficient, whether it is skipped,
//      the next loss scale;
//   3. for each unit: one thread turns its step count and the step's factors into its AdamW
//      scalars (a skipped step leaves both), then the AdamW kernel reads them; host placement
//      copies the factors home with the gradients and the CPU reads them;
//   4. the releases the trainer made.
// Nothing waits on the host: the decision is read on the device (or, for host placement, by the
// CPU AdamW on its own stream). With a communicator the sums run over the reduced gradients, the
// same on every rank, so every rank skips, clips and scales alike.

#include "runtime/runtime_impl.hpp"

#include <taskswap/config.hpp>

#include "kernels/kernels.hpp"
#include "numeric/align.hpp"

#include <algorithm>
#include <cmath>

namespace taskswap {

using detail::ensure;
using detail::message;
using detail::round_up;

std::size_t all_pinned_budget(const runtime_options& options, std::span<const unit_spec> units)
{
  std::size_t packed = 0;  // as the plan check counts pinned units: each at a 256-byte offset
  for (const unit_spec& u : units) {
    packed += round_up(footprint(u, policy_for(u, options).optimizer).device_bytes, 256);
  }
  const std::size_t granule = make_device(options.device).granularity();
  std::size_t budget = round_up(packed, granule);
  if (detail::guarded_step::guards(options)) { budget += round_up(step_guard_device_bytes(units.size()), granule); }
  return budget;
}

// A trained unit's step() in a guarded step: its update waits for end_step.
void runtime::impl::defer_update(unit_record& r, stream_view s)
{
  // Gradients completed on another stream (grads_ready's): the step point follows them.
  if (!reduced_ && r.grads_ready_event && r.grads_ready_event->recorded() && !r.grads_ready_event->query()) {
    r.grads_ready_event->wait(s);
  }
  ensure(r.step_point, device_).record(s);
  go(r, detail::phase_move::defer_to_end_step);
  guard_->defer(r.index);
}

// The trainer lets go of a unit whose update waits for end_step: it keeps its room until then.
void runtime::impl::defer_release(unit_record& r, stream_view s)
{
  ensure(r.trainer_released, device_).record(s);
  go(r, detail::phase_move::defer_release);
  units_.count_let_go();
}

void runtime::impl::finish_guarded_step()
{
  detail::guarded_step& g = *guard_;
  stream& aux = *streams_.aux;
  g.wait_for_last(aux);
  const std::span<const std::uint32_t> deferred = g.deferred();
  for (const std::uint32_t u : deferred) {
    unit_record& r = units_[u];
    if (r.step_point && r.step_point->recorded() && !r.step_point->query()) { r.step_point->wait(aux); }
    // The trainer's work up to its release (it may still read the parameters after step()).
    if (r.phase() == detail::step_phase::release_deferred && !r.trainer_released->query()) {
      r.trainer_released->wait(aux);
    }
    if (reduced_) {
      const event* reduced = reduced_->reduction().reduced(u);
      TASKSWAP_EXPECTS(reduced != nullptr, message("end_step: the reduction of '", r.name, "' was not launched"));
      if (!reduced->query()) { reduced->wait(aux); }
    }
    detail::square_sum_async(r.slot->data() + r.grads_at(), r.layout.grad, r.layout.trainable, g.state(),
                             g.block_sums(), aux);
  }
  const adamw_options& optimizer = step_optimizer();
  const detail::guard_settings settings{.clip = static_cast<float>(optimizer.clip),
                                        .scaler = options_.scaler.enabled,
                                        .growth_factor = static_cast<float>(options_.scaler.growth_factor),
                                        .backoff_factor = static_cast<float>(options_.scaler.backoff_factor),
                                        .growth_interval = static_cast<std::int32_t>(options_.scaler.growth_interval)};
  detail::finish_guard_async(g.state(), settings, aux);
  for (const std::uint32_t u : deferred) {
    unit_record& r = units_[u];
    guarded_update(r, optimizer);
    // end_step found it released by the trainer, or held by the runtime: aux waited for the
    // trainer's release above.
    release(r, aux, detail::phase_move::update_and_release);
  }
  g.clear_deferred();
  g.record_done(aux);
}

// One unit's update in a guarded step, on aux after the step was finished there.
void runtime::impl::guarded_update(unit_record& r, const adamw_options& optimizer)
{
  detail::guarded_step& g = *guard_;
  stream& aux = *streams_.aux;
  adamw_options decay = optimizer;
  decay.lr *= r.policy.lr_scale;
  if (r.policy.weight_decay) { decay.weight_decay = *r.policy.weight_decay; }
  adamw_options plain = decay;
  plain.weight_decay = 0;
  if (r.policy.optimizer == optimizer_placement::host) {
    // The step's factors come home on aux itself, right after the finish and before a later
    // step's finish can change them, once the unit's previous CPU step has read its copy.
    if (r.host_updated && r.host_updated->recorded() && !r.host_updated->query()) { r.host_updated->wait(aux); }
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the factors' bytes
    copy_async(std::span<std::byte>(reinterpret_cast<std::byte*>(g.unit_guard(r.index)), sizeof(detail::step_guard)),
               g.state_bytes(), aux);
    host_step(r, detail::update_scalars{}, aux, detail::guarded_host_update{decay, plain});
    return;
  }
  detail::prepare_guarded_async(decay, plain, g.device_step(r.index), g.state(), g.scalars(), aux);
  const detail::unit_layout& l = r.layout;
  const detail::adamw_slabs whole = l.slabs_at(r.slot->data(), l.device_grads);
  for (const detail::adamw_run& run : l.runs) {
    detail::adamw_async(l.run_slabs(whole, run), g.scalars() + (run.decay ? 0 : 1), g.state(), aux);
  }
  fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, aux);
  go(r, detail::coherence_move::step_on_device);
}

loss_scaler_state runtime::impl::scaler_state()
{
  TASKSWAP_EXPECTS(guard_.has_value(), "scaler_state: steps are not guarded; enable [scaler] or set [optimizer] clip");
  if (life_.started) { guard_->download(streams_.d2h); }  // before start the host copies are current
  wait_streams("scaler_state");
  guard_->read_steps(units_);
  const detail::step_guard& s = guard_->host_state();
  return {.scale = s.scale,
          .growth_tracker = s.growth_tracker,
          .skipped_steps = s.skipped_steps,
          .steps = s.steps,
          .last_skipped = s.skip != 0,
          .last_norm = s.norm};
}

}  // namespace taskswap
