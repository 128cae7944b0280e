// SPDX-License-Identifier: Apache-2.0
#pragma once

// The device pool: the device bytes the runtime may use. It takes the budget from the backend at
// construction as physical memory in granules (whole granules of the budget; the rest is never
// taken) and maps granules into address ranges with the backend's virtual memory calls, so a
// range's bytes need not be contiguous in physical memory and free room never splits: any request
// of at most the free granules is met (DESIGN invariant 9). Every resident slab and staging buffer
// comes out of it, so device bytes held never exceed the budget (invariant 1). Thread-safe.
//
// - Pinned ranges are packed one after another (256-byte aligned) into one region whose granules
//   are mapped as it grows and never given back.
// - Every other range is a slot: an address range reserved once, of its largest size, that keeps
//   its address for the pool's life. Mapping a slot takes whole granules; unmapping frees them at
//   once (the caller orders their reuse after the slot's last use, as before) but leaves them
//   mapped at the slot, so mapping it again while they are still free needs no mapping call. Only
//   when they were taken does the slot move to other granules, after `quiesce` has waited for the
//   slot's previous users (a granule may stay mapped at several slots; only the owner uses it).
//
// docs/runtime.md gives the design and why.

#include <taskswap/device.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace taskswap::detail {

struct device_pool_stats {
  std::size_t budget = 0;       // as configured
  std::size_t capacity = 0;     // the whole granules of the budget: what can be taken
  std::size_t granule = 0;      // the mapping granularity of the device
  std::size_t used = 0;         // bytes of the granules taken, rounding included
  std::size_t requested = 0;    // bytes the live ranges asked for; used - requested is the rounding
  std::size_t peak = 0;         // the most `used` has been
  std::size_t allocations = 0;  // live ranges (pinned ones included)
};

// A run of granules: [first, first + count).
struct granule_run {
  std::size_t first = 0;
  std::size_t count = 0;
};

// The free granules as coalesced runs; a request takes the smallest run that holds it whole, or
// else the largest runs first (the fewest mapping calls).
class granule_runs {
 public:
  explicit granule_runs(std::size_t granules);
  [[nodiscard]] std::size_t free() const noexcept { return free_; }
  [[nodiscard]] bool is_free(granule_run r) const;
  void take(granule_run r);  // r must be free
  void take(std::size_t count, std::vector<granule_run>& into);  // count must be at most free()
  void give(granule_run r);

 private:
  void insert(std::size_t first, std::size_t count);
  void erase(std::map<std::size_t, std::size_t>::iterator it);

  std::size_t free_ = 0;
  std::map<std::size_t, std::size_t> by_first_;           // first -> count
  std::set<std::pair<std::size_t, std::size_t>> by_size_;  // (count, first)
};

class device_pool {
 public:
  using slot_id = std::uint32_t;

  /// Takes the whole granules of `budget` from `dev`.
  /// @throws invalid_argument for a budget smaller than one granule
  /// @throws out_of_memory when the device cannot hold the budget, with what it has free
  device_pool(const device& dev, std::size_t budget);
  ~device_pool();
  device_pool(const device_pool&) = delete;
  device_pool& operator=(const device_pool&) = delete;
  device_pool(device_pool&&) = delete;
  device_pool& operator=(device_pool&&) = delete;

  [[nodiscard]] std::size_t granule() const noexcept { return granule_; }
  /// The bytes a range of `bytes` takes: whole granules.
  [[nodiscard]] std::size_t taken(std::size_t bytes) const noexcept { return (bytes + granule_ - 1) / granule_ * granule_; }
  /// The bytes of the free granules.
  [[nodiscard]] std::size_t free() const;

  /// A range of `bytes` (256-byte aligned) that stays mapped for the pool's life.
  /// @throws out_of_memory naming the budget and the bytes in use
  [[nodiscard]] device_span place_pinned(std::size_t bytes);

  /// A slot of up to `max_bytes`, unmapped; its address is reserved now.
  [[nodiscard]] slot_id add_slot(std::size_t max_bytes);
  /// Maps `bytes` at the unmapped slot; nothing (and no change) when fewer granules are free.
  /// `quiesce` runs before the slot's addresses move to other granules: the slot's previous users
  /// must be done then.
  [[nodiscard]] std::optional<device_span> try_map(slot_id slot, std::size_t bytes, const std::function<void()>& quiesce);
  /// As try_map(), but out_of_memory naming the budget and the bytes in use.
  [[nodiscard]] device_span map(slot_id slot, std::size_t bytes, const std::function<void()>& quiesce);
  /// Frees the slot's granules. The caller orders their reuse after the slot's last use.
  void unmap(slot_id slot);
  /// Keeps the first `bytes` of the mapped slot and frees the granules past them; returns the
  /// kept range. The caller orders the freed granules' reuse as for unmap().
  [[nodiscard]] device_span shrink(slot_id slot, std::size_t bytes);
  /// Unmaps the slot and gives back its addresses; no work may use it any more.
  void remove_slot(slot_id slot);

  [[nodiscard]] device_pool_stats stats() const;
  [[nodiscard]] const device& get_device() const noexcept { return dev_; }

 private:
  struct slot_state {
    std::byte* address = nullptr;
    std::size_t max_granules = 0;
    std::vector<granule_run> mapped;  // at address, in order; the first `owned` granules are its own
    std::size_t owned = 0;
    std::size_t bytes = 0;            // asked for by the live mapping
    bool live = false;
  };
  [[noreturn]] void throw_full(std::size_t bytes, const char* what) const;
  [[nodiscard]] device_span map_locked(slot_state& s, std::size_t bytes, const std::function<void()>& quiesce);
  void unmap_all(slot_state& s);
  void give_from(slot_state& s, std::size_t from_granule);
  void note_peak();
  [[nodiscard]] slot_state& live_slot(slot_id slot, const char* call);

  device dev_;
  std::size_t budget_;
  std::size_t granule_;
  std::size_t granules_;
  void* physical_ = nullptr;
  mutable std::mutex mutex_;
  granule_runs free_;
  std::size_t peak_ = 0;
  // The pinned region: reserved for the whole capacity, mapped as it grows.
  std::byte* pinned_address_ = nullptr;
  std::vector<granule_run> pinned_mapped_;
  std::size_t pinned_granules_ = 0;
  std::size_t pinned_bytes_ = 0;   // packed, alignment included
  std::size_t pinned_ranges_ = 0;
  std::size_t pinned_asked_ = 0;   // bytes asked for
  std::vector<slot_state> slots_;
  std::size_t slot_bytes_ = 0;  // asked for by the mapped slots
  std::size_t live_slots_ = 0;
};

}  // namespace taskswap::detail
