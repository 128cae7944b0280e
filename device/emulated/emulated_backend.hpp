// SPDX-License-Identifier: Apache-2.0
#pragma once

// The emulated backend: device memory is host memory under a byte budget; each stream is a worker
// thread that runs its queue in order; events are generations that streams and the host wait on;
// an optional link model makes host<->device copies take the time a PCIe link would.

#include "device/backend.hpp"

#include <atomic>
#include <chrono>
#include <exception>
#include <string>
#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace taskswap::detail {

class emulated_queue;

class emulated_backend final : public backend {
 public:
  emulated_backend(const emulated_options& options, const emulated_faults& faults);
  ~emulated_backend() override;
  emulated_backend(const emulated_backend&) = delete;
  emulated_backend& operator=(const emulated_backend&) = delete;
  emulated_backend(emulated_backend&&) = delete;
  emulated_backend& operator=(emulated_backend&&) = delete;

  [[nodiscard]] backend_kind kind() const noexcept override { return backend_kind::emulated; }
  [[nodiscard]] int index() const noexcept override { return index_; }
  [[nodiscard]] std::string name() const override;
  [[nodiscard]] memory_info memory() const override;
  [[nodiscard]] std::pair<int, int> stream_priority_range() const override { return {0, 0}; }
  [[nodiscard]] std::string pci_bus_id() const override { return {}; }
  void synchronize() override;
  void abandon_work(const std::exception_ptr& why) noexcept override;

  [[nodiscard]] std::byte* allocate(std::size_t bytes) override;
  void deallocate(std::byte* p, std::size_t bytes) noexcept override;
  [[nodiscard]] std::size_t vm_granularity() const override { return options_.granularity; }
  [[nodiscard]] bool vm_maps_memory() const override { return maps_pages(); }
  [[nodiscard]] void* vm_create(std::size_t granules) override;
  void vm_release(void* handle, std::size_t granules) override;
  [[nodiscard]] std::byte* vm_reserve(std::size_t bytes) override;
  void vm_free(std::byte* va, std::size_t bytes) noexcept override;
  void vm_map(std::byte* va, void* handle, std::size_t granules) override;
  void vm_unmap(std::byte* va, std::size_t granules) override;

  [[nodiscard]] std::byte* allocate_pinned(std::size_t bytes) override;
  void deallocate_pinned(std::byte* p, std::size_t bytes) noexcept override;

  void register_host(void* p, std::size_t bytes) override;
  void unregister_host(void* p, std::size_t bytes) noexcept override;

  [[nodiscard]] void* create_stream(int priority, bool host_synchronous) override;
  [[nodiscard]] void* adopt_stream(std::uintptr_t handle) override;
  void destroy_stream(void* s) noexcept override;
  void synchronize_stream(void* s) override;
  [[nodiscard]] bool query_stream(void* s) override;

  void copy_async(void* dst, const void* src, std::size_t bytes, copy_direction direction, void* s) override;
  void fill_async(void* dst, std::byte value, std::size_t bytes, void* s) override;
  void launch_host_func(void* s, std::function<void()> fn) override;

  [[nodiscard]] void* create_event(bool timing) override;
  void destroy_event(void* e) noexcept override;
  void record_event(void* e, void* s) override;
  void wait_event(void* s, void* e) override;
  void synchronize_event(void* e) override;
  [[nodiscard]] bool synchronize_event_for(void* e, std::chrono::nanoseconds timeout) override;
  [[nodiscard]] bool query_event(void* e) override;
  [[nodiscard]] double elapsed_ms(void* start, void* end) override;

 private:
  // One direction of the link: copies in it are serialised in the order they reserve time.
  struct link_channel {
    std::mutex mutex;
    std::chrono::steady_clock::time_point free_at{};
  };
  void transfer(link_channel& channel, void* dst, const void* src, std::size_t bytes);
  // The virtual-memory cost model: whether copies or other work are in flight, the host time a
  // call costs its caller under the model, and the charge of that time.
  [[nodiscard]] bool busy();
  [[nodiscard]] double cost(const vm_call_cost& c, std::size_t calls, std::size_t bytes);
  void charge(double seconds, std::chrono::steady_clock::time_point started);
  // Injected faults: the device's state after a failed copy, and the check every call makes.
  [[nodiscard]] bool faulted() const noexcept { return faulted_.load(std::memory_order_acquire); }
  void fault(std::exception_ptr why) noexcept;
  void check_fault() const;

  const emulated_options options_;
  const emulated_faults faults_;
  const int index_;
  std::atomic<std::uint64_t> copies_{0};
  std::atomic<std::uint64_t> allocations_{0};
  std::atomic<bool> faulted_{false};
  mutable std::mutex fault_mutex_;
  std::exception_ptr fault_;

  // Counts `bytes` against the device's memory (and the injected allocation fault).
  void take_memory(std::size_t bytes);
  void give_memory(std::size_t bytes) noexcept;
  [[nodiscard]] bool maps_pages() const noexcept;

  mutable std::mutex memory_mutex_;
  std::size_t used_bytes_ = 0;

  std::mutex queues_mutex_;
  std::set<emulated_queue*> queues_;

  link_channel host_to_device_;
  link_channel device_to_host_;

  // Virtual memory (emulated_vm.cpp): the memory file of page granules and what is mapped where.
  struct vm_table {
    std::mutex mutex;
    int fd = -1;  // the memory file, made at the first handle (page granules only)
    std::map<std::size_t, std::size_t> free_runs;  // first granule -> count, of the memory file
    std::map<std::uintptr_t, std::pair<std::size_t, void*>> mapped;  // address -> (granules, handle)
    vm_table() = default;
    ~vm_table();
    vm_table(const vm_table&) = delete;
    vm_table& operator=(const vm_table&) = delete;
    vm_table(vm_table&&) = delete;
    vm_table& operator=(vm_table&&) = delete;
    [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> take(std::size_t count);
    void give(std::size_t first, std::size_t count);
  };
  vm_table vm_;
};

}  // namespace taskswap::detail
