// SPDX-License-Identifier: Apache-2.0
// The public device layer: argument checks, ownership, and dispatch to the device's backend.

#include "device/backend.hpp"
#include "device/cuda/cuda_backend.hpp"
#include "device/emulated/emulated_backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <taskswap/device.hpp>

#include <algorithm>
#include <utility>

namespace taskswap {

std::string_view to_string(backend_kind kind) noexcept { return kind == backend_kind::cuda ? "cuda" : "emulated"; }

// --- device -----------------------------------------------------------------

device::device(std::shared_ptr<detail::backend> backend) noexcept : backend_(std::move(backend)) {}

backend_kind device::kind() const noexcept { return backend_->kind(); }
int device::index() const noexcept { return backend_->index(); }
std::string device::name() const { return backend_->name(); }
memory_info device::memory() const { return backend_->memory(); }
std::pair<int, int> device::stream_priority_range() const { return backend_->stream_priority_range(); }
std::string device::pci_bus_id() const { return backend_->pci_bus_id(); }
std::size_t device::granularity() const { return backend_->vm_granularity(); }
void device::synchronize() const { backend_->synchronize(); }

int cuda_device_count() noexcept { return detail::cuda_device_count(); }

device cuda_device(int index) { return device{detail::cuda_backend_for(index)}; }

device emulated_device(const emulated_options& options) { return emulated_device(options, emulated_faults{}); }

bool vm_cost_model::enabled() const noexcept
{
  for (const vm_call_cost* c : {&map, &access, &unmap, &create, &release}) {
    if (c->per_call_seconds > 0 || c->per_mib_seconds > 0) { return true; }
  }
  return false;
}

// Note [The h200 profile]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Measured by bench/vmm_probe.cu on an H200 (driver 580.159, 2 MiB granules; docs/gpu-results.md),
// the device idle. Each figure is per handle: one cuMemMap maps a handle whole (the driver refuses
// an offset into one), and cuMemSetAccess and cuMemUnmap cost the same per handle whatever its
// size (a handle of 96 granules: 35 and 20 us; 96 handles of one granule: 2.0 and 1.35 ms). With
// a copy or a kernel in flight each call takes about twice as long. The link: 55 GB/s one way,
// 101 GB/s both ways at once (cuda_copy_duplex).
emulated_options emulated_profile(std::string_view name, emulated_options base)
{
  TASKSWAP_EXPECTS(name == "h200",
                   detail::message("unknown emulated device profile '", name, "'; the profiles are: h200"));
  constexpr double us = 1e-6;
  base.granularity = std::size_t{2} << 20;
  base.link = {.bytes_per_second = 52e9, .latency_seconds = 8 * us};
  base.vm_costs = {.map = {0.7 * us, 0.0},
                   .access = {33 * us, 0.015 * us},
                   .unmap = {20 * us, 0.0},
                   .create = {8 * us, 0.14 * us},
                   .release = {9.5 * us, 0.55 * us},
                   .busy_factor = 2.0};
  return base;
}

device emulated_device(const emulated_options& options, const emulated_faults& faults)
{
  TASKSWAP_EXPECTS(options.memory_bytes > 0,
                   "emulated device needs memory_bytes > 0; give it the device memory to emulate");
  TASKSWAP_EXPECTS(
    options.link.bytes_per_second >= 0.0 && options.link.latency_seconds >= 0.0,
    detail::message("emulated link model needs non-negative numbers, got ", options.link.bytes_per_second, " B/s and ",
                    options.link.latency_seconds, " s latency"));
  TASKSWAP_EXPECTS(options.granularity >= 256 && (options.granularity & (options.granularity - 1)) == 0,
                   detail::message("emulated device granularity must be a power of two of at least 256 bytes, got ",
                                   options.granularity));
  TASKSWAP_EXPECTS(options.time_scale > 0.0,
                   detail::message("emulated device time_scale must be more than 0, got ", options.time_scale));
  TASKSWAP_EXPECTS(
    options.vm_costs.busy_factor >= 1.0,
    detail::message("emulated device vm busy_factor must be at least 1, got ", options.vm_costs.busy_factor));
  return device{std::make_shared<detail::emulated_backend>(options, faults)};
}

namespace {

std::string where(const detail::backend& b) { return detail::message(to_string(b.kind()), ":", b.index()); }

void expect_same_device(const detail::backend* memory_owner, const detail::backend& stream_owner, const char* what)
{
  TASKSWAP_EXPECTS(
    memory_owner == &stream_owner,
    detail::message(what, " belongs to device ", memory_owner ? where(*memory_owner) : std::string{"<none>"},
                    " but the stream belongs to device ", where(stream_owner),
                    "; use a stream of the device that owns the memory"));
}

void expect_copy_sizes(std::size_t dst, std::size_t src, const void* dst_data, const void* src_data)
{
  TASKSWAP_EXPECTS(dst == src, detail::message("copy_async: destination has ", dst, " bytes but source has ", src,
                                               "; pass ranges of equal size (subspan)"));
  TASKSWAP_EXPECTS(src == 0 || (dst_data != nullptr && src_data != nullptr),
                   detail::message("copy_async: null ", dst_data == nullptr ? "destination" : "source", " pointer for ",
                                   src, " bytes"));
}

}  // namespace

// --- stream -----------------------------------------------------------------

void stream_view::synchronize() const
{
  backend_->synchronize_stream(handle_);
  backend_->error_slot(handle_)->rethrow();
}

bool stream_view::query() const { return backend_->query_stream(handle_); }

stream_view external_stream(const device& dev, std::uintptr_t handle)
{
  return {&dev.backend(), dev.backend().adopt_stream(handle)};
}

stream::stream(const device& dev, stream_options options) : device_(dev), priority_(options.priority)
{
  auto [least, greatest] = dev.stream_priority_range();
  const int lo = std::min(least, greatest);
  const int hi = std::max(least, greatest);
  TASKSWAP_EXPECTS(options.priority >= lo && options.priority <= hi,
                   detail::message("stream priority ", options.priority, " is outside device ", where(dev.backend()),
                                   "'s range [", lo, ", ", hi, "]"));
  handle_ = dev.backend().create_stream(options.priority, options.host_synchronous);
  dev.backend().open_error_slot(handle_);
}

stream::~stream() { reset(); }

// The moved-from stream keeps its device (a handle), for its destructor.
stream::stream(stream&& other) noexcept
    : device_(other.device_),  // NOLINT(performance-move-constructor-init)
      handle_(std::exchange(other.handle_, nullptr)),
      priority_(other.priority_)
{}

stream& stream::operator=(stream&& other) noexcept
{
  if (this != &other) {
    reset();
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
    priority_ = other.priority_;
  }
  return *this;
}

void stream::reset() noexcept
{
  if (handle_ != nullptr) {
    device_.backend().close_error_slot(handle_);
    device_.backend().destroy_stream(std::exchange(handle_, nullptr));
  }
}

// --- event ------------------------------------------------------------------

event::event(const device& dev, event_options options)
    : device_(dev), handle_(dev.backend().create_event(options.timing)), timing_(options.timing)
{}

event::~event() { reset(); }

// The moved-from event keeps its device (a handle), for its destructor.
event::event(event&& other) noexcept
    : device_(other.device_),  // NOLINT(performance-move-constructor-init)
      handle_(std::exchange(other.handle_, nullptr)),
      timing_(other.timing_),
      recorded_(std::exchange(other.recorded_, false))
{}

event& event::operator=(event&& other) noexcept
{
  if (this != &other) {
    reset();
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
    timing_ = other.timing_;
    recorded_ = std::exchange(other.recorded_, false);
  }
  return *this;
}

void event::reset() noexcept
{
  if (handle_ != nullptr) { device_.backend().destroy_event(std::exchange(handle_, nullptr)); }
}

void event::record(stream_view s)
{
  expect_same_device(&device_.backend(), s.backend(), "event::record: the event");
  device_.backend().record_event(handle_, s.native_handle());
  recorded_ = true;
}

void event::wait(stream_view s) const
{
  expect_same_device(&device_.backend(), s.backend(), "event::wait: the event");
  device_.backend().wait_event(s.native_handle(), handle_);
}

void event::synchronize() const { device_.backend().synchronize_event(handle_); }

bool event::synchronize_for(std::chrono::nanoseconds timeout) const
{
  // A deadline of now + timeout must not overflow: beyond a year, wait without one.
  if (timeout >= std::chrono::hours(24 * 365)) {
    synchronize();
    return true;
  }
  return device_.backend().synchronize_event_for(handle_, timeout);
}

bool event::query() const { return device_.backend().query_event(handle_); }

double elapsed_ms(const event& start, const event& end)
{
  TASKSWAP_EXPECTS(start.timing() && end.timing(),
                   "elapsed_ms needs two events created with event_options{.timing = true}");
  TASKSWAP_EXPECTS(start.get_device() == end.get_device(), "elapsed_ms needs two events of the same device");
  TASKSWAP_EXPECTS(start.recorded() && end.recorded(), "elapsed_ms needs two recorded events");
  TASKSWAP_EXPECTS(start.query() && end.query(), "elapsed_ms: an event has not completed; synchronize it first");
  return start.get_device().backend().elapsed_ms(start.native_handle(), end.native_handle());
}

// --- spans and buffers -------------------------------------------------------

template <typename T>
basic_device_span<T> basic_device_span<T>::subspan(std::size_t offset, std::size_t count) const
{
  TASKSWAP_EXPECTS(
    offset <= size_ && count <= size_ - offset,
    detail::message("range [", offset, ", ", offset + count, ") reaches beyond a device span of ", size_, " bytes"));
  return {owner_, data_ + offset, count};
}

template class basic_device_span<std::byte>;
template class basic_device_span<const std::byte>;

namespace {
void release_device(detail::backend& b, std::byte* p, std::size_t bytes) noexcept { b.deallocate(p, bytes); }
void release_pinned(detail::backend& b, std::byte* p, std::size_t bytes) noexcept { b.deallocate_pinned(p, bytes); }
}  // namespace

device_buffer::device_buffer(const device& dev, std::size_t bytes)
    : bytes_(dev, bytes > 0 ? dev.backend().allocate(bytes) : nullptr, bytes, release_device)
{}

pinned_buffer::pinned_buffer(const device& dev, std::size_t bytes)
    : bytes_(dev, bytes > 0 ? dev.backend().allocate_pinned(bytes) : nullptr, bytes, release_pinned)
{}

// --- operations on a stream --------------------------------------------------

void copy_async(device_span dst, std::span<const std::byte> src, stream_view s)
{
  expect_copy_sizes(dst.size(), src.size(), dst.data(), src.data());
  if (src.empty()) { return; }
  expect_same_device(dst.owner(), s.backend(), "copy_async: the destination");
  s.backend().copy_async(dst.data(), src.data(), src.size(), detail::copy_direction::host_to_device, s.native_handle());
}

void copy_async(std::span<std::byte> dst, const_device_span src, stream_view s)
{
  expect_copy_sizes(dst.size(), src.size(), dst.data(), src.data());
  if (src.empty()) { return; }
  expect_same_device(src.owner(), s.backend(), "copy_async: the source");
  s.backend().copy_async(dst.data(), src.data(), src.size(), detail::copy_direction::device_to_host, s.native_handle());
}

void copy_async(device_span dst, const_device_span src, stream_view s)
{
  expect_copy_sizes(dst.size(), src.size(), dst.data(), src.data());
  if (src.empty()) { return; }
  expect_same_device(dst.owner(), s.backend(), "copy_async: the destination");
  expect_same_device(src.owner(), s.backend(), "copy_async: the source");
  s.backend().copy_async(dst.data(), src.data(), src.size(), detail::copy_direction::device_to_device,
                         s.native_handle());
}

void fill_async(device_span dst, std::byte value, stream_view s)
{
  if (dst.empty()) { return; }
  TASKSWAP_EXPECTS(dst.data() != nullptr, detail::message("fill_async: null pointer for ", dst.size(), " bytes"));
  expect_same_device(dst.owner(), s.backend(), "fill_async: the destination");
  s.backend().fill_async(dst.data(), value, dst.size(), s.native_handle());
}

void launch_host_func(stream_view s, std::function<void()> fn)
{
  TASKSWAP_EXPECTS(static_cast<bool>(fn), "launch_host_func needs a callable, got an empty function");
  s.backend().launch_host_func(s.native_handle(), std::move(fn));
}

}  // namespace taskswap
