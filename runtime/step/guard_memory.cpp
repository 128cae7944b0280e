// SPDX-License-Identifier: Apache-2.0
// The guarded step's memory and its copies (guard_memory.hpp).

#include "runtime/step/guard_memory.hpp"

#include "kernels/kernels.hpp"
#include "numeric/align.hpp"

#include <taskswap/runtime.hpp>

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

std::size_t guard_memory::device_bytes(std::size_t units) noexcept { return step_guard_device_bytes(units); }

std::size_t guard_memory::host_bytes(std::size_t units) noexcept
{
  return guard_state_bytes + round_up(2 * units * sizeof(std::int64_t), 256) + units * sizeof(step_guard);
}

guard_memory::guard_memory(const device& dev, std::size_t units, std::span<std::byte> host, float scale)
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

void guard_memory::upload(std::span<const std::int64_t> steps, stream_view s)
{
  for (std::size_t i = 0; i < units_; ++i) { host_steps_[i] = device_steps_[i] = steps[i]; }
  const std::size_t n = units_ * sizeof(std::int64_t);
  copy_async(memory_.span(steps_offset, n), bytes_of(static_cast<const void*>(device_steps_), n), s);
  copy_async(memory_.span(0, sizeof(step_guard)), bytes_of(static_cast<const void*>(host_state_), sizeof(step_guard)),
             s);
  record_done(s);
}

void guard_memory::download(stream_view s)
{
  if (!done_.query()) { done_.wait(s); }
  const std::size_t n = units_ * sizeof(std::int64_t);
  const device_buffer& m = memory_;
  copy_async(bytes_of(static_cast<void*>(host_state_), sizeof(step_guard)), m.span(0, sizeof(step_guard)), s);
  copy_async(bytes_of(static_cast<void*>(device_steps_), n), m.span(steps_offset, n), s);
  downloaded_ = true;
}

const_device_span guard_memory::state_bytes() const { return memory_.span(0, sizeof(step_guard)); }

}  // namespace detail
}  // namespace taskswap
