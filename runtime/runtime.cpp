// SPDX-License-Identifier: Apache-2.0
// The runtime's public methods, each a thin forward to runtime::impl (runtime_impl.hpp says which
// file holds what), and the small value types of the public header.

#include "runtime/runtime_impl.hpp"

#include <taskswap/cpu_adamw.hpp>

#include <algorithm>
#include <cstddef>

namespace taskswap {

using detail::message;

std::string_view to_string(residency r) noexcept
{
  switch (r) {
    case residency::pinned: return "pinned";
    case residency::on_demand: return "on_demand";
    case residency::prefetch: break;
  }
  return "prefetch";
}

std::string_view to_string(optimizer_placement p) noexcept
{
  return p == optimizer_placement::host ? "host" : "device";
}

std::string_view to_string(unit_use u) noexcept
{
  switch (u) {
    case unit_use::frozen: return "frozen";
    case unit_use::stash: return "stash";
    case unit_use::train: break;
  }
  return "train";
}

void* unit_view::param(std::size_t i) const
{
  TASKSWAP_EXPECTS(i < tensors.size(), detail::message("tensor ", i, " of a unit with ", tensors.size()));
  return static_cast<std::byte*>(params.data) + tensors[i].offset * size_of(params.type);
}

void* unit_view::grad(std::size_t i) const
{
  TASKSWAP_EXPECTS(i < tensors.size(), detail::message("tensor ", i, " of a unit with ", tensors.size()));
  TASKSWAP_EXPECTS(!frozen, "grad(): the unit is used frozen and has no gradients; plan and acquire it with "
                            "unit_use::train to train it");
  TASKSWAP_EXPECTS(!tensors[i].state, detail::message("grad(", i, "): tensor '", tensors[i].name,
                                                      "' is a state tensor; it has no gradient"));
  return static_cast<std::byte*>(grads.data) + tensors[i].offset * size_of(grads.type);
}

tensor_view unit_view::param_tensor(std::size_t i) const
{
  std::byte* p = static_cast<std::byte*>(param(i));
  return {device_span(owner, p, tensors[i].count * size_of(params.type)), params.type, tensors[i].shape,
          tensors[i].count};
}

tensor_view unit_view::grad_tensor(std::size_t i) const
{
  std::byte* p = static_cast<std::byte*>(grad(i));
  return {device_span(owner, p, tensors[i].count * size_of(grads.type)), grads.type, tensors[i].shape,
          tensors[i].count};
}

void tensor_view::check_element(std::size_t size, bool floating) const
{
  const bool fits = size == size_of(type) && floating == (type == dtype::f32);
  TASKSWAP_EXPECTS(fits, detail::message("tensor_view::data<T>(): the tensor is ", to_string(type), "; use ",
                                         type == dtype::f32  ? "float"
                                         : type == dtype::u8 ? "std::uint8_t (its bytes)"
                                                             : "std::uint16_t (its bits)"));
}

step_plan::step_plan(std::initializer_list<unit_id> acquisitions)
    : step_plan(std::span<const unit_id>(acquisitions.begin(), acquisitions.size()))
{}

step_plan::step_plan(std::span<const unit_id> acquisitions)
{
  entries_.reserve(acquisitions.size());
  for (const unit_id u : acquisitions) { entries_.push_back({u, true, unit_use::train}); }
}

step_plan& step_plan::acquire(unit_id u, unit_use use)
{
  entries_.push_back({u, true, use});
  return *this;
}

step_plan& step_plan::release(unit_id u)
{
  entries_.push_back({u, false, unit_use::train});
  return *this;
}

runtime::runtime(const device& dev, const runtime_options& options, const std::vector<unit_spec>& units)
    : impl_(std::make_unique<impl>(dev, options, units, nullptr))
{}

runtime::runtime(const device& dev, const runtime_options& options, const std::vector<unit_spec>& units,
                 std::shared_ptr<communicator> comm)
    : impl_(std::make_unique<impl>(dev, options, units, std::move(comm)))
{}

runtime::~runtime() = default;
runtime::runtime(runtime&&) noexcept = default;
runtime& runtime::operator=(runtime&&) noexcept = default;

unit_id runtime::find(std::string_view name) const
{
  const std::optional<std::uint32_t> found = impl_->units_.find(name);
  TASKSWAP_EXPECTS(found.has_value(), message("no unit is named '", name, "'"));
  return unit_id{*found};
}

std::size_t runtime::unit_count() const noexcept { return impl_->units_.size(); }
std::string_view runtime::name(unit_id u) const { return impl_->units_.at(u).name; }
const unit_policy& runtime::policy(unit_id u) const { return impl_->units_.at(u).policy; }
std::size_t runtime::device_bytes(unit_id u) const { return impl_->units_.at(u).layout.device_bytes; }

unit_state runtime::state(unit_id u) const { return detail::state_of(impl_->units_.at(u)); }

home_view runtime::home(unit_id u)
{
  // Not guarded: after a failure the home copies stay readable. A disk home's failed read leaves
  // it absent from the cache, and a victim's failed write leaves that block dirty: nothing is lost.
  detail::unit_record& r = impl_->units_.at(u);
  if (impl_->life_.failed && r.home.cache != nullptr && r.home.cache->behind(r.home.entry)) {
    throw storage_error(message("the home of unit '", r.name, "' in '", r.home.cache->file(r.home.entry).string(),
                                "' is older than its last write-back: its newest bytes were in the device copy, "
                                "which the failure lost; resume from the last checkpoint"));
  }
  const detail::unit_layout& l = r.layout;
  home_view v;
  v.id = u;
  v.tensors = l.tensors;
  std::byte* home = r.home_block();
  r.home_used(nullptr, true);  // the trainer may write it (a disk home's cache block is then dirty)
  r.home_written = r.home_written || !impl_->life_.started;
  v.params = {home + l.params, l.compute, l.count};
  const std::size_t state = l.frozen ? 0 : l.count;  // a unit never trained has no optimizer state
  v.master = {home + l.master, dtype::f32, state};
  v.m = {home + l.m, dtype::f32, state};
  v.v = {home + l.v, dtype::f32, state};
  v.step = r.step;
  return v;
}

void runtime::plan(std::span<const step_plan> steps)
{
  impl_->guarded([&] {
    impl_->plan(steps);
    impl_->units_.check_all("plan", false, impl_->path());
  });
}

unit_view runtime::acquire(unit_id u, stream_view s, unit_use use)
{
  return impl_->guarded([&] {
    const detail::step_phase before = impl_->units_.phase_before(u);
    unit_view v = impl_->trainer_acquire(u, s, use);
    impl_->units_.check_unit(u, before, detail::acquire_moves, "acquire", impl_->path());
    return v;
  });
}

void runtime::grads_ready(unit_id u, stream_view s)
{
  impl_->guarded([&] {
    const detail::step_phase before = impl_->units_.phase_before(u);
    impl_->trainer_grads_ready(u, s);
    impl_->units_.check_unit(u, before, 0, "grads_ready", impl_->path());
  });
}

void runtime::step(unit_id u, stream_view s)
{
  impl_->guarded([&] {
    const detail::step_phase before = impl_->units_.phase_before(u);
    impl_->trainer_step(u, s);
    impl_->units_.check_unit(u, before, detail::step_moves, "step", impl_->path());
  });
}

void runtime::release(unit_id u, stream_view s)
{
  impl_->guarded([&] {
    const detail::step_phase before = impl_->units_.phase_before(u);
    impl_->trainer_release(u, s);
    impl_->units_.check_unit(u, before, detail::release_moves(impl_->path()), "release", impl_->path());
  });
}

void runtime::skip(std::span<const unit_id> units)
{
  impl_->guarded([&] {
    std::vector<detail::step_phase> before;
    if (impl_->units_.checks_states()) {
      for (const unit_id u : units) { before.push_back(impl_->units_.phase_before(u)); }
    }
    const std::vector<bool> reduced = impl_->trainer_skip(units);
    if (!impl_->units_.checks_states()) { return; }
    const std::uint32_t moves = detail::skip_moves(impl_->path());
    for (std::size_t i = 0; i < units.size(); ++i) {
      const auto earlier = units.begin() + static_cast<std::ptrdiff_t>(i);
      if (std::find(units.begin(), earlier, units[i]) != earlier) { continue; }  // named twice: checked once
      // A unit with nothing to reduce stays as it was; one to reduce has left idle.
      impl_->units_.check_unit(units[i], before[i], reduced[i] ? moves : 0, "skip", impl_->path());
    }
  });
}

step_stats runtime::end_step()
{
  return impl_->guarded([&] {
    step_stats done = impl_->end_step();
    impl_->units_.check_all("end_step", true, impl_->path());
    return done;
  });
}

int runtime::agree_stop(int local)
{
  return impl_->guarded([&] {
    impl_->check_comm();  // a failed gradient collective is the failure to report, as on every call
    return impl_->reduced_ ? impl_->reduced_->reduction().stop_vote(local) : local;
  });
}

void runtime::flush()
{
  impl_->guarded([&] {
    impl_->flush();
    impl_->units_.check_all("flush", false, impl_->path());
  });
}

void runtime::save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user)
{
  impl_->guarded([&] { impl_->save_checkpoint(dir, user); });
}

// Not guarded: after a failed load the runtime refuses every call but another load.
checkpoint_manifest runtime::load_checkpoint(const std::filesystem::path& dir) { return impl_->load_checkpoint(dir); }

void runtime::set_optimizer(const adamw_options& options)
{
  if (const std::string problem = adamw_options_problem(options); !problem.empty()) {
    throw config_error(message("set_optimizer: ", problem, "; nothing was changed"));
  }
  if (options.clip > 0 && !impl_->guard_) {
    throw config_error(message("set_optimizer: clip = ", options.clip,
                               " on a runtime made without clipping; set "
                               "[optimizer] clip (or enable [scaler]) when the runtime is made; nothing was changed"));
  }
  impl_->options_.optimizer = options;
}

const adamw_options& runtime::optimizer() const noexcept { return impl_->options_.optimizer; }

bool runtime::guards_steps() const noexcept { return impl_->guard_.has_value(); }

const float* runtime::loss_scale() const
{
  TASKSWAP_EXPECTS(impl_->guard_ && impl_->options_.scaler.enabled,
                   "loss_scale: no loss scaler is enabled; set [scaler] enabled = true");
  return &impl_->guard_->state()->scale;
}

loss_scaler_state runtime::scaler_state()
{
  return impl_->guarded([&] { return impl_->scaler_state(); });
}

int runtime::rank() const noexcept { return impl_->reduced_ ? impl_->reduced_->reduction().rank() : 0; }

int runtime::world_size() const noexcept { return impl_->reduced_ ? impl_->reduced_->reduction().world() : 1; }

runtime_stats runtime::stats() const { return impl_->stats(); }

void runtime::write_trace(const std::filesystem::path& file)
{
  impl_->guarded([&] { impl_->write_trace(file); });
}

const device& runtime::get_device() const noexcept { return impl_->device_; }

}  // namespace taskswap
