// SPDX-License-Identifier: Apache-2.0
#pragma once

// The interface each device backend implements. Public types (stream, event, buffers) hold a
// backend and opaque handles; argument checks happen in the public layer (device.cpp), so a
// backend receives only valid, same-device arguments.

#include <taskswap/device.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace taskswap::detail {

enum class copy_direction { host_to_device, device_to_host, device_to_device };

// The first exception a stream's host functions threw since its last synchronize. Queued host
// functions share the slot, so one that runs after its stream (or device) is gone writes to a slot
// nobody reads, never to another stream's.
class host_func_errors {
 public:
  void keep(std::exception_ptr error) noexcept;
  void rethrow();

 private:
  std::mutex mutex_;
  std::exception_ptr first_;
};

class backend {
 public:
  backend() = default;
  virtual ~backend() = default;
  backend(const backend&) = delete;
  backend& operator=(const backend&) = delete;
  backend(backend&&) = delete;
  backend& operator=(backend&&) = delete;

  [[nodiscard]] virtual backend_kind kind() const noexcept = 0;
  [[nodiscard]] virtual int index() const noexcept = 0;
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual memory_info memory() const = 0;
  [[nodiscard]] virtual std::pair<int, int> stream_priority_range() const = 0;
  // "0000:65:00.0" for a PCI device; empty where the device has no PCI location (emulated).
  [[nodiscard]] virtual std::string pci_bus_id() const = 0;
  virtual void synchronize() = 0;

  // After a failure whose queued consequences must not take effect (a collective that never
  // completed: the gradients it was to produce are not there), the device abandons its queued
  // work: the emulated backend skips every later copy, fill and host function, and every later
  // call rethrows `why` (as after its injected faults). CUDA has no such switch: there the runtime
  // stops writing home once it sees the failure.
  virtual void abandon_work(const std::exception_ptr& /*why*/) noexcept {}

  // Device memory: 256-byte aligned. deallocate waits for the device's queued work.
  [[nodiscard]] virtual std::byte* allocate(std::size_t bytes) = 0;
  virtual void deallocate(std::byte* p, std::size_t bytes) noexcept = 0;
  // Virtual memory, for the device pool (DESIGN invariant 8): physical memory in handles of whole
  // granules of vm_granularity() bytes, each handle mapped whole into reserved address ranges, so
  // that a range's bytes need not be contiguous in physical memory. A handle may be mapped at
  // several addresses at once. None of these calls touches data, waits for the device or orders
  // anything: the caller unmaps or releases only what no queued work still uses. They may be made
  // from a thread other than the one that queues work (the pool's mapping thread).
  [[nodiscard]] virtual std::size_t vm_granularity() const = 0;
  // Whether a range's bytes are its handles' (so remapping a range in use would lose them);
  // false where each range keeps bytes of its own (an emulated granule below a page).
  [[nodiscard]] virtual bool vm_maps_memory() const { return true; }
  // One handle of `granules` granules, counted against the device's memory (cuMemCreate).
  // @throws out_of_memory when the device cannot hold it
  [[nodiscard]] virtual void* vm_create(std::size_t granules) = 0;
  // Frees a handle mapped nowhere (cuMemRelease).
  virtual void vm_release(void* handle, std::size_t granules) = 0;
  // An address range of `bytes` (a multiple of the granularity), mapped to nothing.
  [[nodiscard]] virtual std::byte* vm_reserve(std::size_t bytes) = 0;
  virtual void vm_free(std::byte* va, std::size_t bytes) noexcept = 0;
  // Maps the whole handle at `va`, readable and writable by the device (cuMemMap with offset 0,
  // cuMemSetAccess); `va` must be unmapped there.
  virtual void vm_map(std::byte* va, void* handle, std::size_t granules) = 0;
  // Unmaps [va, va + granules): handles mapped whole, one after another (one cuMemUnmap).
  virtual void vm_unmap(std::byte* va, std::size_t granules) = 0;

  [[nodiscard]] virtual std::byte* allocate_pinned(std::size_t bytes) = 0;
  virtual void deallocate_pinned(std::byte* p, std::size_t bytes) noexcept = 0;

  // Page-locks existing host memory for the device's copy engines (cudaHostRegister on cuda;
  // mlock on emulated, which copies from pageable memory equally well and locks only when asked).
  virtual void register_host(void* p, std::size_t bytes) = 0;
  virtual void unregister_host(void* p, std::size_t bytes) noexcept = 0;

  // host_synchronous: see stream_options (the emulated backend only).
  [[nodiscard]] virtual void* create_stream(int priority, bool host_synchronous) = 0;
  // A stream another library made (a framework's current stream), by its integer handle; 0 is the
  // device's legacy default stream. Never destroyed by taskswap.
  [[nodiscard]] virtual void* adopt_stream(std::uintptr_t handle) = 0;
  virtual void destroy_stream(void* s) noexcept = 0;
  virtual void synchronize_stream(void* s) = 0;
  [[nodiscard]] virtual bool query_stream(void* s) = 0;

  virtual void copy_async(void* dst, const void* src, std::size_t bytes, copy_direction direction, void* s) = 0;
  virtual void fill_async(void* dst, std::byte value, std::size_t bytes, void* s) = 0;
  virtual void launch_host_func(void* s, std::function<void()> fn) = 0;

  [[nodiscard]] virtual void* create_event(bool timing) = 0;
  virtual void destroy_event(void* e) noexcept = 0;
  virtual void record_event(void* e, void* s) = 0;
  virtual void wait_event(void* s, void* e) = 0;
  virtual void synchronize_event(void* e) = 0;
  [[nodiscard]] virtual bool synchronize_event_for(void* e, std::chrono::nanoseconds timeout) = 0;
  [[nodiscard]] virtual bool query_event(void* e) = 0;
  [[nodiscard]] virtual double elapsed_ms(void* start, void* end) = 0;

  // Host functions that throw: the exception is kept in the stream's slot and rethrown by the
  // stream's next synchronize (CUDA cannot carry it; both backends behave the same). The public
  // stream opens the slot after create_stream and closes it before destroy_stream.
  void open_error_slot(void* s);
  void close_error_slot(void* s) noexcept;
  [[nodiscard]] std::shared_ptr<host_func_errors> error_slot(void* s);

 private:
  std::mutex error_slots_mutex_;
  std::map<void*, std::shared_ptr<host_func_errors>> error_slots_;
};

// Runs a host function as both backends must: exceptions go to the slot, never escape.
void run_host_func(host_func_errors& slot, const std::function<void()>& fn) noexcept;

}  // namespace taskswap::detail
