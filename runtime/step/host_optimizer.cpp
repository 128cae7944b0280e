// SPDX-License-Identifier: Apache-2.0
// Host placement: gradients home, the CPU AdamW on the host-optimizer stream, parameters back up.

#include "runtime/runtime_impl.hpp"

#include "host/cpu_adamw.hpp"
#include "kernels/kernels.hpp"

namespace taskswap {

using detail::ensure;

// After a host step: the new parameters go up once the CPU AdamW wrote them and the trainer let
// go of the old ones.
void runtime::impl::upload_params(unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  swap_->flush_h2d_waits();
  r.released.wait(streams_.h2d);
  r.host_updated->wait(streams_.h2d);
  const std::size_t span = trace_.recorder ? trace_.recorder->open(trace_.h2d, "params " + r.name, streams_.h2d) : 0;
  r.stage_in(0, r.slot->subspan(0, l.travel_bytes), streams_.h2d);
  r.arrived.record(streams_.h2d);
  if (trace_.recorder) { trace_.recorder->close(span, streams_.h2d); }
  go(r, detail::coherence_move::upload_params);
  ledger_.upload(l.travel_bytes);
}

// Gradients home on d2h (after the previous CPU step let go of them), then the CPU AdamW on
// host_opt; the device parameters are stale until uploaded again. Does not synchronise.
void runtime::impl::host_step(unit_record& r, const detail::update_scalars& scalars, stream_view s,
                              std::optional<detail::guarded_host_update> guarded)
{
  const detail::unit_layout& l = r.layout;
  ensure(r.grads_done, device_).record(s);
  r.grads_done->wait(streams_.d2h);
  if (r.host_updated && r.host_updated->recorded()) { r.host_updated->wait(streams_.d2h); }
  const std::size_t grad_bytes = l.device_grad_bytes();
  const std::size_t span = trace_.recorder ? trace_.recorder->open(trace_.d2h, "grads " + r.name, streams_.d2h) : 0;
  r.write_home(l.home_grads, const_device_span(r.slot->subspan(r.grads_at(), grad_bytes)), streams_.d2h);
  fill_async(r.slot->subspan(r.grads_at(), grad_bytes), std::byte{0}, streams_.d2h);
  if (const std::size_t state = l.state_tensor_bytes();
      state != 0 && !r.grads_only()) {  // written home with the update
    r.write_home(l.state_at(), const_device_span(r.slot->subspan(l.state_at(), state)), streams_.d2h);
    ledger_.to_home(state);
  }
  detail::step_guard* factors = nullptr;
  std::int64_t* step = nullptr;
  if (guarded) {  // the finished step's factors, copied home on `s` (guarded_update)
    factors = guard_->unit_guard(r.index);
    step = guard_->host_step(r.index);
  }
  ensure(r.grads_copied, device_).record(streams_.d2h);
  if (trace_.recorder) { trace_.recorder->close(span, streams_.d2h); }
  ledger_.to_home(grad_bytes);
  r.grads_copied->wait(streams_.host_opt);
  std::vector<std::pair<detail::adamw_slabs, bool>> runs;  // the slabs, and whether they decay
  const detail::adamw_slabs whole = l.slabs_at(r.home_block(), l.home_grads);
  for (const detail::adamw_run& run : l.runs) { runs.emplace_back(l.run_slabs(whole, run), run.decay); }
  // The store order is the whole unit's (Note [Grouped stores]): a run past a 16-bit slab's start
  // is no longer staggered against the f32 ones, though the unit's slabs are.
  const bool grouped = detail::grouped_stores(whole);
  detail::host_task_arena* cpu = &*streams_.cpu;
  detail::trace_recorder* trace = trace_.recorder ? &*trace_.recorder : nullptr;
  launch_host_func(streams_.host_opt, [runs = std::move(runs), scalars, guarded, factors, step, cpu, trace,
                                       track = trace_.host, name = r.name, grouped] {
    detail::update_scalars k = scalars;
    if (guarded) {
      detail::adamw_scalars both[2];
      detail::prepare_guarded_scalars(guarded->decay, guarded->plain, *step, *factors, both);
      if (factors->skip != 0) { return; }
      k = {both[0], both[1]};
    }
    const auto begin = detail::trace_recorder::clock::now();
    for (const auto& [slabs, decay] : runs) {
      detail::cpu_adamw_step(slabs, decay ? k.decay : k.no_decay, *cpu, detail::best_cpu_isa(), grouped);
    }
    if (trace != nullptr) { trace->host_span(track, "adamw " + name, begin, detail::trace_recorder::clock::now()); }
  });
  const stream_view opt = streams_.host_opt;
  r.home_used(&opt, true);  // the CPU AdamW writes the home block on host_opt
  ensure(r.host_updated, device_).record(streams_.host_opt);
  go(r, detail::coherence_move::step_on_host);
}

}  // namespace taskswap
