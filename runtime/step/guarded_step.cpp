// SPDX-License-Identifier: Apache-2.0
// A guarded step's state: its memory, its copies, its deferred updates (guarded_step.hpp).

#include "runtime/step/guarded_step.hpp"

#include "kernels/kernels.hpp"
#include "numeric/align.hpp"

#include <taskswap/runtime.hpp>

#include <algorithm>
#include <cmath>

namespace taskswap {

namespace {

constexpr std::size_t guard_state_bytes = 256;
constexpr std::size_t block_sums_bytes = detail::square_sum_blocks * sizeof(double);
constexpr std::size_t scalars_bytes = 256;  // two adamw_scalars
constexpr std::size_t steps_offset = guard_state_bytes + block_sums_bytes + scalars_bytes;

// NOLINTBEGIN(cppcoreguidelines-pro-type-reinterpret-cast): the layouts of device_bytes and host_bytes
template <typename T>
T* at(std::byte* base, std::size_t offset)
{
  return reinterpret_cast<T*>(base + offset);
}
std::span<const std::byte> bytes_of(const void* p, std::size_t n) { return {static_cast<const std::byte*>(p), n}; }
std::span<std::byte> bytes_of(void* p, std::size_t n) { return {static_cast<std::byte*>(p), n}; }
// NOLINTEND(cppcoreguidelines-pro-type-reinterpret-cast)

}  // namespace

std::size_t step_guard_device_bytes(std::size_t units) noexcept
{
  return guard_state_bytes + block_sums_bytes + scalars_bytes + detail::round_up(units * sizeof(std::int64_t), 256);
}

namespace detail {

void guarded_step::check_scaler(const runtime_options& options)
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

std::size_t guarded_step::device_bytes(std::size_t units) noexcept { return step_guard_device_bytes(units); }

std::size_t guarded_step::host_bytes(std::size_t units) noexcept
{
  return guard_state_bytes + round_up(2 * units * sizeof(std::int64_t), 256) + units * sizeof(step_guard);
}

guarded_step::guarded_step(const device& dev, std::size_t units, std::span<std::byte> host, float scale)
    : units_(units), memory_(dev, device_bytes(units)), done_(dev)
{
  std::byte* d = static_cast<std::byte*>(memory_.data());
  state_ = at<step_guard>(d, 0);
  block_sums_ = at<double>(d, guard_state_bytes);
  scalars_ = at<adamw_scalars>(d, guard_state_bytes + block_sums_bytes);
  steps_ = at<std::int64_t>(d, steps_offset);
  std::byte* h = host.data();
  host_state_ = at<step_guard>(h, 0);
  host_steps_ = at<std::int64_t>(h, guard_state_bytes);
  device_steps_ = host_steps_ + units;
  unit_guards_ = at<step_guard>(h, guard_state_bytes + round_up(2 * units * sizeof(std::int64_t), 256));
  *host_state_ = step_guard{};
  host_state_->scale = scale;
}

void guarded_step::upload(const unit_table& units, stream_view s)
{
  for (std::size_t i = 0; i < units_; ++i) { host_steps_[i] = device_steps_[i] = units[i].step; }
  const std::size_t n = units_ * sizeof(std::int64_t);
  copy_async(memory_.span(steps_offset, n), bytes_of(static_cast<const void*>(device_steps_), n), s);
  copy_async(memory_.span(0, sizeof(step_guard)), bytes_of(static_cast<const void*>(host_state_), sizeof(step_guard)),
             s);
  record_done(s);
}

void guarded_step::download(stream_view s)
{
  if (!done_.query()) { done_.wait(s); }
  const std::size_t n = units_ * sizeof(std::int64_t);
  const device_buffer& m = memory_;
  copy_async(bytes_of(static_cast<void*>(host_state_), sizeof(step_guard)), m.span(0, sizeof(step_guard)), s);
  copy_async(bytes_of(static_cast<void*>(device_steps_), n), m.span(steps_offset, n), s);
  downloaded_ = true;
}

void guarded_step::read_steps(unit_table& units)
{
  if (!downloaded_) { return; }
  downloaded_ = false;
  for (std::size_t i = 0; i < units_; ++i) {
    units[i].step = units[i].policy.optimizer == optimizer_placement::host ? host_steps_[i] : device_steps_[i];
  }
}

const_device_span guarded_step::state_bytes() const { return memory_.span(0, sizeof(step_guard)); }

std::span<const std::uint32_t> guarded_step::deferred()
{
  std::sort(deferred_.begin(), deferred_.end());
  deferred_.erase(std::unique(deferred_.begin(), deferred_.end()), deferred_.end());
  return deferred_;
}

}  // namespace detail
}  // namespace taskswap
