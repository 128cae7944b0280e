// SPDX-License-Identifier: Apache-2.0
#pragma once

// The device pool: the device bytes the runtime may use, taken from the backend as one allocation
// of exactly the budget and sub-allocated best-fit with coalescing (device/best_fit_ranges).
// Every resident slab and staging buffer comes out of it, so device bytes held never exceed the
// budget (invariant 1 of DESIGN.md). Thread-safe.

#include "device/best_fit_ranges.hpp"

#include <taskswap/device.hpp>

#include <cstddef>
#include <mutex>
#include <optional>

namespace taskswap::detail {

struct device_pool_stats {
  std::size_t budget = 0;
  std::size_t used = 0;          // bytes in live allocations, alignment padding included
  std::size_t peak = 0;          // the most `used` has been
  std::size_t largest_free = 0;
  std::size_t allocations = 0;   // live
  [[nodiscard]] double fragmentation() const noexcept
  {
    const std::size_t free = budget - used;
    return free == 0 ? 0.0 : 1.0 - static_cast<double>(largest_free) / static_cast<double>(free);
  }
};

class device_pool {
 public:
  /// Takes `budget` bytes of `dev` in one allocation.
  /// @throws invalid_argument for a zero budget
  /// @throws out_of_memory when the device cannot hold the budget, with what it has free
  device_pool(const device& dev, std::size_t budget);

  /// A range of `bytes` aligned to `alignment` (a power of two, at least 256).
  /// @throws out_of_memory naming the budget, the bytes in use and the largest free block
  [[nodiscard]] device_span allocate(std::size_t bytes, std::size_t alignment = 256);
  /// As allocate(), but nothing when no free block holds it.
  [[nodiscard]] std::optional<device_span> try_allocate(std::size_t bytes, std::size_t alignment = 256);
  /// Returns a range obtained from allocate(). The caller orders it after the range's last use
  /// on every stream (the runtime does so with events).
  /// @throws invalid_argument if `range` is not a live allocation of this pool
  void deallocate(device_span range);
  /// Keeps the first `bytes` of a live allocation and frees the rest; returns the kept range.
  /// The caller orders the freed tail after its last use, as for deallocate().
  /// @throws invalid_argument if `range` is not a live allocation or `bytes` is not less than its size
  [[nodiscard]] device_span shrink(device_span range, std::size_t bytes);

  [[nodiscard]] device_pool_stats stats() const;
  [[nodiscard]] const device& get_device() const noexcept { return memory_.get_device(); }

 private:
  device_buffer memory_;
  mutable std::mutex mutex_;
  best_fit_ranges ranges_;
  std::size_t peak_ = 0;
};

}  // namespace taskswap::detail
