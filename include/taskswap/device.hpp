// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The device layer: devices, streams, events, device and pinned host buffers, and the
/// asynchronous operations on a stream. One interface over two backends: `cuda` (a real GPU) and
/// `emulated` (host memory under a byte budget, a worker thread per stream, an optional link
/// model), with the same ordering semantics.

#include <taskswap/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace taskswap {

namespace detail {
class backend;
}

/// @brief Which implementation a device uses.
enum class backend_kind { cuda, emulated };

/// @brief "cuda" or "emulated".
[[nodiscard]] std::string_view to_string(backend_kind kind) noexcept;

/// @brief The time an emulated copy between host and device takes: latency + bytes / rate.
/// One link per direction, as PCIe is full duplex; copies in the same direction share it in the
/// order they start, copies in opposite directions overlap.
struct link_model {
  double bytes_per_second = 0.0;  ///< 0: no model, copies take what memcpy takes
  double latency_seconds = 0.0;  ///< fixed cost per copy

  /// @brief Whether the model shapes copies at all.
  [[nodiscard]] bool enabled() const noexcept { return bytes_per_second > 0.0; }
};

/// @brief The host time one kind of virtual-memory call costs the thread that makes it:
/// `per_call` + `per_mib` × the MiB it covers.
struct vm_call_cost {
  double per_call_seconds = 0.0;
  double per_mib_seconds = 0.0;
};

/// @brief What an emulated device's virtual-memory calls cost the calling thread, as the CUDA
/// driver's do (docs/gpu-results.md measures them on an H200). A mapping call maps one physical
/// handle; access is granted per handle mapped; an unmap is charged per handle it unmaps. The
/// emulator's own work in a call (backing memory, page tables) is part of the time charged.
struct vm_cost_model {
  vm_call_cost map{};  ///< cuMemMap: one handle at one address
  vm_call_cost access{};  ///< cuMemSetAccess, per handle in the granted range
  vm_call_cost unmap{};  ///< cuMemUnmap, per handle in the range
  vm_call_cost create{};  ///< cuMemCreate of one handle
  vm_call_cost release{};  ///< cuMemRelease of one handle
  double busy_factor = 1.0;  ///< the costs' multiple while copies or other work run on the device

  /// @brief Whether any call costs time.
  [[nodiscard]] bool enabled() const noexcept;
};

/// @brief Settings of an emulated device.
struct emulated_options {
  std::size_t memory_bytes = std::size_t{1} << 30;  ///< device memory: allocations beyond it fail
  link_model link{};  ///< host<->device copy timing
  /// The granule in which the device pool maps memory (a power of two, at least 256). A multiple
  /// of the host page maps a shared memory file into each range, as CUDA maps physical pages, so
  /// two ranges can alias one granule. Smaller granules are counted the same way, but each range
  /// keeps bytes of its own (there is no mapping hardware below a page).
  std::size_t granularity = 256;
  vm_cost_model vm_costs{};  ///< host time of the virtual-memory calls (none by default)
  /// The device runs this many times slower than its figures say: the link's rate is divided by
  /// it, its latency and the virtual-memory costs multiplied. A machine whose memory copies
  /// cannot keep up with a fast link (55 GB/s) still shows the same ratios of link, mapping and
  /// compute time at a scale it can keep (10: a 5.5 GB/s link).
  double time_scale = 1.0;
};

/// @brief A named set of an emulated device's figures, measured on a real GPU.
/// "h200": an NVIDIA H200 on PCIe Gen5 (docs/gpu-results.md): 2 MiB granules, a link of
/// 52 GB/s each way with 8 us latency, and its driver's virtual-memory costs. Keeps `memory_bytes`
/// and `time_scale` of `base`.
/// @throws invalid_argument naming the known profiles for another name
[[nodiscard]] emulated_options emulated_profile(std::string_view name, emulated_options base = {});

/// @brief Faults an emulated device injects, to test what fails how. Host↔device copies are
/// counted in the order they are enqueued over all the device's streams, from 1; allocations of
/// device memory likewise; 0 injects nothing.
struct emulated_faults {
  /// This copy fails: nothing is copied and the device turns faulty, as after a CUDA sticky
  /// error: the copies, fills and host functions queued after it are skipped, and every later
  /// call that enqueues, waits or queries throws device_error (waits return first). (A failed
  /// collective or a runtime timeout turns the device faulty the same way, with its own error.)
  std::uint64_t fail_copy = 0;
  /// This copy stalls its stream for `stall` before it runs (a hung transfer).
  std::uint64_t stall_copy = 0;
  std::chrono::milliseconds stall{10'000};
  /// This allocation throws out_of_memory.
  std::uint64_t fail_allocation = 0;
};

/// @brief Free and total device memory, in bytes.
struct memory_info {
  std::size_t free = 0;
  std::size_t total = 0;
};

/// @brief A device: a backend and its index. Cheap to copy; every copy refers to the same
/// device, and objects made on it (streams, buffers) keep it alive.
class device {
 public:
  /// @brief The backend that implements this device.
  [[nodiscard]] backend_kind kind() const noexcept;
  /// @brief The device index (the CUDA ordinal, or the emulated device's serial number).
  [[nodiscard]] int index() const noexcept;
  /// @brief A human-readable name ("NVIDIA H100 80GB HBM3", "emulated:0").
  [[nodiscard]] std::string name() const;
  /// @brief Free and total device memory now.
  /// @throws cuda_error if the query fails
  [[nodiscard]] memory_info memory() const;
  /// @brief Stream priorities: {least, greatest}. Numerically lower is higher priority on CUDA;
  /// the emulated backend has a single priority, {0, 0}.
  [[nodiscard]] std::pair<int, int> stream_priority_range() const;
  /// @brief The PCI bus id ("0000:65:00.0"), or empty for a device without one (emulated).
  [[nodiscard]] std::string pci_bus_id() const;
  /// @brief The granule in which the runtime's device pool maps memory: every swapped unit takes
  /// whole granules of its budget (CUDA's minimum granularity, typically 2 MiB; the emulated
  /// device's `granularity`).
  /// @throws cuda_error if the driver lacks virtual memory management
  [[nodiscard]] std::size_t granularity() const;
  /// @brief Blocks the host until all work on every stream of the device is done. For tests and
  /// tools only; the library never calls it on a hot path.
  void synchronize() const;

  /// @brief The implementation; for taskswap's own components.
  [[nodiscard]] detail::backend& backend() const noexcept { return *backend_; }

  friend bool operator==(const device& a, const device& b) noexcept { return a.backend_ == b.backend_; }

  /// @brief Wraps a backend; use cuda_device() or emulated_device().
  explicit device(std::shared_ptr<detail::backend> backend) noexcept;

 private:
  std::shared_ptr<detail::backend> backend_;
};

/// @brief Number of CUDA devices usable by this process: 0 without a driver, without a device,
/// or when taskswap was built without CUDA. Never throws.
[[nodiscard]] int cuda_device_count() noexcept;

/// @brief The CUDA device with the given ordinal. Every call with the same ordinal returns an
/// equal device.
/// @throws cuda_error if taskswap was built without CUDA or the ordinal does not exist
[[nodiscard]] device cuda_device(int index = 0);

/// @brief A new emulated device (each call makes a distinct one with its own memory).
/// @throws invalid_argument if memory_bytes is 0 or the link model has a negative field
[[nodiscard]] device emulated_device(const emulated_options& options = {});

/// @brief A new emulated device that injects `faults`.
/// @param options its memory and link model
/// @param faults what to inject (tests of failure handling)
[[nodiscard]] device emulated_device(const emulated_options& options, const emulated_faults& faults);

/// @brief A non-owning reference to a stream. Copyable, never null.
class stream_view {
 public:
  stream_view(int) = delete;  // NOLINT(google-explicit-constructor): a stream is not a number
  stream_view(std::nullptr_t) = delete;  // no default stream: every stream is explicit

  /// @brief The backend's stream handle (a cudaStream_t on the cuda backend).
  [[nodiscard]] void* native_handle() const noexcept { return handle_; }
  /// @brief The backend of the stream's device.
  [[nodiscard]] detail::backend& backend() const noexcept { return *backend_; }
  /// @brief Blocks the host until all work queued on the stream is done. Rethrows the first
  /// exception a host function on this stream threw since the last synchronize.
  void synchronize() const;
  /// @brief True when all work queued so far is done. Does not block.
  [[nodiscard]] bool query() const;

  friend bool operator==(stream_view a, stream_view b) noexcept
  {
    return a.backend_ == b.backend_ && a.handle_ == b.handle_;
  }

  /// @brief For backends and tests: wraps a handle of the given backend.
  stream_view(detail::backend* backend, void* handle) noexcept : backend_(backend), handle_(handle) {}

 private:
  detail::backend* backend_;
  void* handle_;
};

/// @brief A view of a stream another library owns, such as PyTorch's current stream
/// (`torch.cuda.current_stream().cuda_stream`), so the runtime orders its work on it. Taskswap
/// never destroys it; the owner keeps it alive while the view is used.
/// @param dev the device the stream belongs to
/// @param handle a `cudaStream_t` as an integer; 0 is the device's legacy default stream (every
/// operation on it makes `dev` the calling thread's current device for its duration)
/// @throws invalid_argument on the emulated backend (its streams are its own queues), or for a
/// stream of another device
/// @throws cuda_error for a handle CUDA does not know
[[nodiscard]] stream_view external_stream(const device& dev, std::uintptr_t handle);

/// @brief Settings of a new stream.
struct stream_options {
  int priority = 0;  ///< within device::stream_priority_range()
  /// The emulated device only: the thread that enqueues an operation runs it before the call
  /// returns (waits included), instead of a worker thread later. For a trainer that computes on
  /// the host (torch on the CPU) and would wait for its stream at every step anyway, this saves
  /// two thread wake-ups per step; the runtime's copy streams stay asynchronous.
  bool host_synchronous = false;
};

/// @brief An owning stream: a queue of operations that run in the order they were enqueued.
/// Non-blocking with respect to other streams (no implicit default-stream ordering). Move-only.
/// Destroying a stream with queued work is allowed: that work still completes.
class stream {
 public:
  /// @brief Creates a stream on the device.
  /// @throws invalid_argument if the priority is outside the device's range, or for a host
  /// synchronous stream on a CUDA device
  /// @throws cuda_error if the backend fails
  explicit stream(const device& dev, stream_options options = {});
  ~stream();
  stream(stream&& other) noexcept;
  stream& operator=(stream&& other) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  /// @brief A view of this stream.
  [[nodiscard]] stream_view view() const noexcept { return {&device_.backend(), handle_}; }
  // NOLINTNEXTLINE(google-explicit-constructor): views convert implicitly
  operator stream_view() const noexcept { return view(); }
  /// @brief The device the stream belongs to.
  [[nodiscard]] const device& get_device() const noexcept { return device_; }
  /// @brief The priority it was created with.
  [[nodiscard]] int priority() const noexcept { return priority_; }
  /// @brief See stream_view::synchronize.
  void synchronize() const { view().synchronize(); }
  /// @brief See stream_view::query.
  [[nodiscard]] bool query() const { return view().query(); }

 private:
  void reset() noexcept;
  device device_;
  void* handle_ = nullptr;
  int priority_ = 0;
};

/// @brief Settings of a new event.
struct event_options {
  bool timing = false;  ///< record timestamps (costs a little on CUDA; off unless timing is measured)
};

/// @brief A point in a stream's work that other streams and the host can wait for. Waits see the
/// most recent record() made before the wait was issued, as CUDA events do; waiting on an event
/// never recorded does not wait. Move-only.
class event {
 public:
  /// @brief Creates an event on the device.
  explicit event(const device& dev, event_options options = {});
  ~event();
  event(event&& other) noexcept;
  event& operator=(event&& other) noexcept;
  event(const event&) = delete;
  event& operator=(const event&) = delete;

  /// @brief Captures the work queued on `s` so far. Does not synchronise.
  /// @throws invalid_argument if `s` belongs to another device
  void record(stream_view s);
  /// @brief Makes `s` wait, before its later work, for the last record(). Does not block the host.
  /// @throws invalid_argument if `s` belongs to another device
  void wait(stream_view s) const;
  /// @brief Blocks the host until the last record() has completed.
  void synchronize() const;
  /// @brief Blocks the host at most `timeout`; true if the last record() completed.
  [[nodiscard]] bool synchronize_for(std::chrono::nanoseconds timeout) const;
  /// @brief True if the last record() has completed (or none was made). Does not block.
  [[nodiscard]] bool query() const;
  /// @brief Whether the event records timestamps.
  [[nodiscard]] bool timing() const noexcept { return timing_; }
  /// @brief Whether record() was called at least once.
  [[nodiscard]] bool recorded() const noexcept { return recorded_; }
  /// @brief The device the event belongs to.
  [[nodiscard]] const device& get_device() const noexcept { return device_; }
  /// @brief The backend's event handle (a cudaEvent_t on the cuda backend).
  [[nodiscard]] void* native_handle() const noexcept { return handle_; }

 private:
  void reset() noexcept;
  device device_;
  void* handle_ = nullptr;
  bool timing_ = false;
  bool recorded_ = false;
};

/// @brief Milliseconds between two completed timing events.
/// @throws invalid_argument if either event lacks timing, they belong to different devices, or
/// either was never recorded or has not completed
[[nodiscard]] double elapsed_ms(const event& start, const event& end);

/// @brief A range of device memory: where it is, how long, and whose. `T` is std::byte or
/// const std::byte.
template <typename T>
class basic_device_span {
 public:
  static_assert(std::is_same_v<std::remove_const_t<T>, std::byte>);

  basic_device_span() noexcept = default;
  /// @brief For buffers and backends: a range of `owner`'s memory.
  basic_device_span(detail::backend* owner, T* data, std::size_t size) noexcept
      : owner_(owner), data_(data), size_(size)
  {}
  /// @brief A mutable span converts to a const one.
  template <typename U>
  requires(std::is_const_v<T> && !std::is_const_v<U>)
    // NOLINTNEXTLINE(google-explicit-constructor): as std::span does
    basic_device_span(basic_device_span<U> other)
  noexcept : owner_(other.owner()), data_(other.data()), size_(other.size()) {}

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] detail::backend* owner() const noexcept { return owner_; }

  /// @brief Bytes [offset, offset + count) of this span.
  /// @throws invalid_argument if the range reaches beyond the span
  [[nodiscard]] basic_device_span subspan(std::size_t offset, std::size_t count) const;

 private:
  detail::backend* owner_ = nullptr;
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

using device_span = basic_device_span<std::byte>;
using const_device_span = basic_device_span<const std::byte>;
extern template class basic_device_span<std::byte>;
extern template class basic_device_span<const std::byte>;

namespace detail {

/// @brief Bytes owned on behalf of a device: freed with `release` at destruction; a move leaves
/// the source empty. The one ownership mechanism behind device_buffer and pinned_buffer.
class owned_bytes {
 public:
  using release_fn = void (*)(backend&, std::byte*, std::size_t) noexcept;
  owned_bytes(device dev, std::byte* data, std::size_t size, release_fn release) noexcept
      : device_(std::move(dev)), data_(data), size_(size), release_(release)
  {}
  ~owned_bytes() { reset(); }
  // The moved-from buffer keeps its device (a handle), for its destructor.
  owned_bytes(owned_bytes&& other) noexcept
      : device_(other.device_),  // NOLINT(performance-move-constructor-init)
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        release_(other.release_)
  {}
  owned_bytes& operator=(owned_bytes&& other) noexcept
  {
    if (this != &other) {
      reset();
      device_ = other.device_;
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      release_ = other.release_;
    }
    return *this;
  }
  owned_bytes(const owned_bytes&) = delete;
  owned_bytes& operator=(const owned_bytes&) = delete;

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] const device& get_device() const noexcept { return device_; }

 private:
  void reset() noexcept
  {
    if (data_ != nullptr) { release_(device_.backend(), std::exchange(data_, nullptr), size_); }
    size_ = 0;
  }
  device device_;
  std::byte* data_;
  std::size_t size_;
  release_fn release_;
};

}  // namespace detail

/// @brief Owning device memory, allocated at construction and freed at destruction. Freeing
/// waits for the device's queued work, as cudaFree does. Move-only (a move leaves the source empty).
class device_buffer {
 public:
  /// @brief Allocates `bytes` (0 gives an empty buffer) with 256-byte alignment.
  /// @throws out_of_memory with the requested, free and total bytes
  device_buffer(const device& dev, std::size_t bytes);

  [[nodiscard]] std::byte* data() noexcept { return bytes_.data(); }
  [[nodiscard]] const std::byte* data() const noexcept { return bytes_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  [[nodiscard]] const device& get_device() const noexcept { return bytes_.get_device(); }

  /// @brief The whole buffer as a span.
  [[nodiscard]] device_span span() noexcept { return {&get_device().backend(), data(), size()}; }
  [[nodiscard]] const_device_span span() const noexcept { return {&get_device().backend(), data(), size()}; }
  /// @brief Bytes [offset, offset + count).
  /// @throws invalid_argument if the range reaches beyond the buffer
  [[nodiscard]] device_span span(std::size_t offset, std::size_t count) { return span().subspan(offset, count); }
  [[nodiscard]] const_device_span span(std::size_t offset, std::size_t count) const
  {
    return span().subspan(offset, count);
  }

 private:
  detail::owned_bytes bytes_;
};

/// @brief Owning page-locked host memory usable by the device's copy engines (cudaHostAlloc on
/// the cuda backend; page-aligned host memory on the emulated one). The NUMA-local arena of the
/// host layer is the way to hold unit homes; this is the simple form. Move-only.
class pinned_buffer {
 public:
  /// @brief Allocates `bytes` (0 gives an empty buffer).
  /// @throws out_of_memory if the host cannot pin that much
  pinned_buffer(const device& dev, std::size_t bytes);

  [[nodiscard]] std::byte* data() noexcept { return bytes_.data(); }
  [[nodiscard]] const std::byte* data() const noexcept { return bytes_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  [[nodiscard]] const device& get_device() const noexcept { return bytes_.get_device(); }
  [[nodiscard]] std::span<std::byte> span() noexcept { return {data(), size()}; }
  [[nodiscard]] std::span<const std::byte> span() const noexcept { return {data(), size()}; }

 private:
  detail::owned_bytes bytes_;
};

/// @brief Copies host memory to device memory on `s`. Does not synchronise: `src` must stay
/// valid and unchanged until the copy completes (pinned memory makes it truly asynchronous).
/// @throws invalid_argument if the sizes differ, a pointer is null, or `dst` and `s` belong to
/// different devices
void copy_async(device_span dst, std::span<const std::byte> src, stream_view s);

/// @brief Copies device memory to host memory on `s`. Does not synchronise.
/// @throws invalid_argument as for the host-to-device copy
void copy_async(std::span<std::byte> dst, const_device_span src, stream_view s);

/// @brief Copies device memory to device memory on `s`. Does not synchronise.
/// @throws invalid_argument as for the host-to-device copy
void copy_async(device_span dst, const_device_span src, stream_view s);

/// @brief Sets every byte of `dst` to `value` on `s`. Does not synchronise.
/// @throws invalid_argument if `dst` and `s` belong to different devices
void fill_async(device_span dst, std::byte value, stream_view s);

/// @brief Runs `fn` on a host thread once the work queued on `s` before it has completed; work
/// queued after it waits for it. Does not synchronise. `fn` must not call taskswap device
/// functions, nor own (capture by value) the last reference to a taskswap stream, event, buffer or
/// device, whose destruction would call the device from the callback (as with cudaLaunchHostFunc).
/// An exception it throws is kept and rethrown by the stream's next synchronize().
void launch_host_func(stream_view s, std::function<void()> fn);

}  // namespace taskswap
