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

namespace {

constexpr std::size_t guard_state_bytes = 256;
constexpr std::size_t block_sums_bytes = detail::square_sum_blocks * sizeof(double);
constexpr std::size_t scalars_bytes = 256;  // two adamw_scalars
constexpr std::size_t steps_offset = guard_state_bytes + block_sums_bytes + scalars_bytes;

}  // namespace

void runtime::impl::check_scaler(const runtime_options& options)
{
  const loss_scaler_options& s = options.scaler;
  if (!s.enabled) { return; }
  const auto fail = [&](const char* key, const char* want) {
    throw config_error(message(options.source, ": [scaler] ", key, ": ", want));
  };
  if (!(s.init_scale > 0 && std::isfinite(s.init_scale) && s.init_scale <= 3.0e38)) {
    fail("init_scale", "must be a positive float, e.g. init_scale = 65536.0");
  }
  if (!(s.growth_factor > 1 && std::isfinite(s.growth_factor))) {
    fail("growth_factor", "must be more than 1, e.g. 2.0");
  }
  if (!(s.backoff_factor > 0 && s.backoff_factor < 1)) { fail("backoff_factor", "must be in (0, 1), e.g. 0.5"); }
  if (!(s.growth_interval >= 1 && s.growth_interval <= 2'000'000'000)) {
    fail("growth_interval", "must be 1 or more, e.g. growth_interval = 2000");
  }
}

bool runtime::impl::guards(const runtime_options& options) noexcept
{
  return options.scaler.enabled || options.optimizer.clip > 0;
}

std::size_t step_guard_device_bytes(std::size_t units) noexcept
{
  return guard_state_bytes + block_sums_bytes + scalars_bytes + round_up(units * sizeof(std::int64_t), 256);
}

std::size_t runtime::impl::guard_device_bytes(std::size_t units) noexcept { return step_guard_device_bytes(units); }

std::size_t all_pinned_budget(const runtime_options& options, std::span<const unit_spec> units)
{
  std::size_t packed = 0;  // as the plan check counts pinned units: each at a 256-byte offset
  for (const unit_spec& u : units) {
    packed += round_up(footprint(u, policy_for(u, options).optimizer).device_bytes, 256);
  }
  const std::size_t granule = make_device(options.device).granularity();
  std::size_t budget = round_up(packed, granule);
  if (options.scaler.enabled || options.optimizer.clip > 0) {
    budget += round_up(step_guard_device_bytes(units.size()), granule);
  }
  return budget;
}

std::size_t runtime::impl::guard_host_bytes(std::size_t units) noexcept
{
  return guard_state_bytes + round_up(2 * units * sizeof(std::int64_t), 256) + units * sizeof(detail::step_guard);
}

void runtime::impl::make_guard(std::span<std::byte> host)
{
  guard_memory g{.memory = device_buffer(device_, guard_device_bytes(units_.size())), .done = event(device_)};
  std::byte* d = static_cast<std::byte*>(g.memory.data());
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the layout above
  g.state = reinterpret_cast<detail::step_guard*>(d);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  g.block_sums = reinterpret_cast<double*>(d + guard_state_bytes);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  g.scalars = reinterpret_cast<detail::adamw_scalars*>(d + guard_state_bytes + block_sums_bytes);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  g.steps = reinterpret_cast<std::int64_t*>(d + steps_offset);
  std::byte* h = host.data();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the layout of guard_host_bytes
  g.host_state = reinterpret_cast<detail::step_guard*>(h);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  g.host_steps = reinterpret_cast<std::int64_t*>(h + guard_state_bytes);
  g.device_steps = g.host_steps + units_.size();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  g.unit_guards = reinterpret_cast<detail::step_guard*>(h + guard_state_bytes +
                                                        round_up(2 * units_.size() * sizeof(std::int64_t), 256));
  *g.host_state = detail::step_guard{};
  g.host_state->scale = static_cast<float>(options_.scaler.enabled ? options_.scaler.init_scale : 1.0);
  guard_.emplace(std::move(g));
}

// At start: the scale (and tracker) and every unit's step count go to the device.
void runtime::impl::upload_guard()
{
  guard_memory& g = *guard_;
  for (const unit_record& r : units_) {
    g.host_steps[r.index] = r.step;
    g.device_steps[r.index] = r.step;
  }
  const std::size_t n = units_.size() * sizeof(std::int64_t);
  copy_async(g.memory.span(steps_offset, n),
             // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
             std::span<const std::byte>(reinterpret_cast<const std::byte*>(g.device_steps), n), h2d_);
  copy_async(g.memory.span(0, sizeof(detail::step_guard)),
             // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
             std::span<const std::byte>(reinterpret_cast<const std::byte*>(g.host_state), sizeof(detail::step_guard)),
             h2d_);
  g.done.record(h2d_);
  g.wait_done = true;
}

// Enqueues the copies of the state and the device step counts home; read them after wait_streams.
void runtime::impl::download_guard()
{
  guard_memory& g = *guard_;
  if (!started_) { return; }  // nothing went up yet: the host copies are current
  if (!g.done.query()) { g.done.wait(d2h_); }
  const std::size_t n = units_.size() * sizeof(std::int64_t);
  const guard_memory& c = g;
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  copy_async(std::span<std::byte>(reinterpret_cast<std::byte*>(g.host_state), sizeof(detail::step_guard)),
             c.memory.span(0, sizeof(detail::step_guard)), d2h_);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  copy_async(std::span<std::byte>(reinterpret_cast<std::byte*>(g.device_steps), n), c.memory.span(steps_offset, n),
             d2h_);
  g.downloaded = true;
}

// After wait_streams: the units' step counts from where each placement keeps them.
void runtime::impl::read_guard_steps()
{
  guard_memory& g = *guard_;
  if (!g.downloaded) { return; }
  g.downloaded = false;
  for (unit_record& r : units_) {
    r.step = r.policy.optimizer == optimizer_placement::host ? g.host_steps[r.index] : g.device_steps[r.index];
  }
}

// A trained unit's step() in a guarded step: its update waits for end_step.
void runtime::impl::defer_update(unit_record& r, stream_view s)
{
  // Gradients completed on another stream (grads_ready's): the step point follows them.
  if (!reducer_ && r.grads_ready_event && r.grads_ready_event->recorded() && !r.grads_ready_event->query()) {
    r.grads_ready_event->wait(s);
  }
  ensure(r.step_point, device_).record(s);
  go(r, detail::phase_move::defer_to_end_step);
  round_.defer(r.index);
}

// The trainer lets go of a unit whose update waits for end_step: it keeps its room until then.
void runtime::impl::defer_release(unit_record& r, stream_view s)
{
  ensure(r.trainer_released, device_).record(s);
  go(r, detail::phase_move::defer_release);
  --held_count_;
}

void runtime::impl::finish_guarded_step()
{
  guard_memory& g = *guard_;
  stream& aux = *aux_;
  if (g.wait_done && !g.done.query()) { g.done.wait(aux); }
  const std::span<const std::uint32_t> deferred = round_.deferred();
  for (const std::uint32_t u : deferred) {
    unit_record& r = units_[u];
    if (r.step_point && r.step_point->recorded() && !r.step_point->query()) { r.step_point->wait(aux); }
    // The trainer's work up to its release (it may still read the parameters after step()).
    if (r.phase() == detail::step_phase::release_deferred && !r.trainer_released->query()) {
      r.trainer_released->wait(aux);
    }
    if (reducer_) {
      const event* reduced = reducer_->reduced(u);
      TASKSWAP_EXPECTS(reduced != nullptr, message("end_step: the reduction of '", r.name, "' was not launched"));
      if (!reduced->query()) { reduced->wait(aux); }
    }
    detail::square_sum_async(r.slot->data() + r.grads_at(), r.layout.grad, r.layout.trainable, g.state, g.block_sums,
                             aux);
  }
  const adamw_options& optimizer = round_.optimizer(options_.optimizer);
  const detail::guard_settings settings{.clip = static_cast<float>(optimizer.clip),
                                        .scaler = options_.scaler.enabled,
                                        .growth_factor = static_cast<float>(options_.scaler.growth_factor),
                                        .backoff_factor = static_cast<float>(options_.scaler.backoff_factor),
                                        .growth_interval = static_cast<std::int32_t>(options_.scaler.growth_interval)};
  detail::finish_guard_async(g.state, settings, aux);
  for (const std::uint32_t u : deferred) {
    unit_record& r = units_[u];
    guarded_update(r, optimizer);
    // end_step found it released by the trainer, or held by the runtime: aux waited for the
    // trainer's release above.
    release(r, aux, detail::phase_move::update_and_release);
  }
  round_.clear_deferred();
  g.done.record(aux);
  g.wait_done = true;
}

// One unit's update in a guarded step, on aux after the step was finished there.
void runtime::impl::guarded_update(unit_record& r, const adamw_options& optimizer)
{
  guard_memory& g = *guard_;
  stream& aux = *aux_;
  adamw_options decay = optimizer;
  decay.lr *= r.policy.lr_scale;
  if (r.policy.weight_decay) { decay.weight_decay = *r.policy.weight_decay; }
  adamw_options plain = decay;
  plain.weight_decay = 0;
  if (r.policy.optimizer == optimizer_placement::host) {
    // The step's factors come home on aux itself, right after the finish and before a later
    // step's finish can change them, once the unit's previous CPU step has read its copy.
    if (r.host_updated && r.host_updated->recorded() && !r.host_updated->query()) { r.host_updated->wait(aux); }
    const guard_memory& c = g;
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    copy_async(std::span<std::byte>(reinterpret_cast<std::byte*>(g.unit_guards + r.index), sizeof(detail::step_guard)),
               c.memory.span(0, sizeof(detail::step_guard)), aux);
    host_step(r, update_scalars{}, aux, guarded_host_update{decay, plain});
    return;
  }
  detail::prepare_guarded_async(decay, plain, g.steps + r.index, g.state, g.scalars, aux);
  const detail::unit_layout& l = r.layout;
  const detail::adamw_slabs whole = l.slabs_at(r.slot->data(), l.device_grads);
  for (const detail::adamw_run& run : l.runs) {
    detail::adamw_async(l.run_slabs(whole, run), g.scalars + (run.decay ? 0 : 1), g.state, aux);
  }
  fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, aux);
  go(r, detail::coherence_move::step_on_device);
}

loss_scaler_state runtime::impl::scaler_state()
{
  TASKSWAP_EXPECTS(guard_.has_value(), "scaler_state: steps are not guarded; enable [scaler] or set [optimizer] clip");
  download_guard();
  wait_streams("scaler_state");
  read_guard_steps();
  const detail::step_guard& s = *guard_->host_state;
  return {.scale = s.scale,
          .growth_tracker = s.growth_tracker,
          .skipped_steps = s.skipped_steps,
          .steps = s.steps,
          .last_skipped = s.skip != 0,
          .last_norm = s.norm};
}

}  // namespace taskswap
