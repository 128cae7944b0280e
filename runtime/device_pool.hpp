// SPDX-License-Identifier: Apache-2.0
#pragma once

// The device pool: the device bytes the runtime may use. It takes the budget from the backend at
// construction as physical memory in granules (whole granules of the budget; the rest is never
// taken) and maps granules into address ranges with the backend's virtual memory calls, so a
// range's bytes need not be contiguous in physical memory and free room never splits: any request
// of at most the free granules is met (DESIGN invariant 8). Every resident slab and staging buffer
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
// - A slot of at most half a granule is packed: it takes a place in a granule shared with slots
//   of its size class (granule / k bytes, 256-byte aligned, k places per granule). A class granule
//   is given back when its last place empties, and stays mapped where it was, as a slot does.
//   Packed slots cost a granule each at most, so a check that charges them a granule is sound;
//   units resident but not held fill granules k at a time.
//
// docs/runtime.md gives the design and why.

#include "runtime/residency_model.hpp"

#include <taskswap/device.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <vector>

namespace taskswap::detail {

struct device_pool_stats {
  std::size_t budget = 0;  // as configured
  std::size_t capacity = 0;  // the whole granules of the budget: what can be taken
  std::size_t granule = 0;  // the mapping granularity of the device
  std::size_t used = 0;  // bytes of the granules taken, rounding included
  std::size_t requested = 0;  // bytes the live ranges asked for; used - requested is the rounding
  std::size_t peak = 0;  // the most `used` has been
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
  std::map<std::size_t, std::size_t> by_first_;  // first -> count
  std::set<std::pair<std::size_t, std::size_t>> by_size_;  // (count, first)
};

class device_pool {
 public:
  using slot_id = std::uint32_t;

  /// Takes the whole granules of `budget` from `dev`.
  /// @throws invalid_argument for a budget smaller than one granule
  /// @throws out_of_memory when the device cannot hold the budget, with what it has free
  device_pool(const device& dev, std::size_t budget);
  /// Prints what close() found, if close() was not called.
  ~device_pool();
  /// Waits for the device, unmaps and frees every range; returns what went wrong (a faulted
  /// device's error, a range that could not be unmapped: then its memory stays reserved) for the
  /// owner to report once with its own. Never throws; the pool is unusable afterwards.
  [[nodiscard]] std::vector<std::string> close() noexcept;
  device_pool(const device_pool&) = delete;
  device_pool& operator=(const device_pool&) = delete;
  device_pool(device_pool&&) = delete;
  device_pool& operator=(device_pool&&) = delete;

  [[nodiscard]] std::size_t granule() const noexcept { return granule_; }
  /// The bytes a range of `bytes` takes: whole granules.
  [[nodiscard]] std::size_t taken(std::size_t bytes) const noexcept { return whole_granules(bytes, granule_); }
  /// The bytes of the free granules.
  [[nodiscard]] std::size_t free() const;

  /// A range of `bytes` (256-byte aligned) that stays mapped for the pool's life.
  /// @throws out_of_memory naming the budget and the bytes in use
  [[nodiscard]] device_span place_pinned(std::size_t bytes);

  /// Whether a slot of `max_bytes` is packed in a pool of `granule`: at most half a granule.
  [[nodiscard]] static bool packs(std::size_t max_bytes, std::size_t granule) noexcept
  {
    return detail::packs(max_bytes, granule);  // the residency model's rule
  }
  [[nodiscard]] bool packs(std::size_t max_bytes) const noexcept { return packs(max_bytes, granule_); }
  /// A slot of up to `max_bytes`, unmapped; its address is reserved now (packed: with its granule).
  [[nodiscard]] slot_id add_slot(std::size_t max_bytes);
  /// Called with each slot whose earlier users must be done before addresses it used move to
  /// other granules.
  using quiesce_fn = std::function<void(slot_id)>;
  /// Whether mapping `bytes` at the unmapped slot would succeed now.
  [[nodiscard]] bool fits(slot_id slot, std::size_t bytes) const;
  /// Maps `bytes` at the unmapped slot; nothing (and no change) when it does not fit.
  [[nodiscard]] std::optional<device_span> try_map(slot_id slot, std::size_t bytes, const quiesce_fn& quiesce);
  /// As try_map(), but out_of_memory naming the budget and the bytes in use.
  [[nodiscard]] device_span map(slot_id slot, std::size_t bytes, const quiesce_fn& quiesce);
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
  static constexpr std::uint32_t none = ~std::uint32_t{0};
  struct slot_state {
    std::byte* address = nullptr;  // packed: nullptr (its place's address while mapped)
    std::size_t max_granules = 0;
    std::vector<granule_run> mapped;  // at address, in order; the first `owned` granules are its own
    std::size_t owned = 0;
    std::size_t bytes = 0;  // asked for by the live mapping
    bool live = false;
    bool removed = false;
    std::uint32_t size_class = none;  // packed: its class
    std::uint32_t shared = none;  // packed and mapped: its class granule ...
    std::uint32_t place = 0;  // ... and its place there
  };
  // A granule shared by the packed slots of one class: its addresses reserved once; its physical
  // granule mapped there while any place is taken, and left mapped (stale) when it empties.
  struct class_granule {
    std::byte* address = nullptr;
    std::size_t granule = 0;  // the physical granule mapped at address
    bool mapped = false;
    std::vector<slot_id> places;  // the slot in each place, or none
    std::size_t taken = 0;  // places taken: while any is, the granule is its own
    std::vector<slot_id> former;  // slots that used it since it was mapped
  };
  struct size_class {
    std::size_t place_bytes = 0;
    std::vector<std::uint32_t> granules;  // into shared_
  };
  [[nodiscard]] static std::size_t round256(std::size_t bytes) noexcept { return (bytes + 255) / 256 * 256; }
  [[nodiscard]] std::uint32_t class_of(std::size_t bytes);
  [[nodiscard]] std::uint32_t open_place(const size_class& c) const;  // a class granule with a free place, or none
  [[nodiscard]] bool has_room(const slot_state& s, std::size_t bytes) const;
  [[noreturn]] void throw_full(std::size_t bytes, const char* what) const;
  [[nodiscard]] device_span map_locked(slot_id id, slot_state& s, std::size_t bytes, const quiesce_fn& quiesce);
  [[nodiscard]] device_span map_packed(slot_id id, slot_state& s, std::size_t bytes, const quiesce_fn& quiesce);
  [[nodiscard]] device_span mapped(slot_state& s, std::size_t bytes, std::byte* at);
  void unmap_packed(slot_state& s);
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
  std::size_t pinned_bytes_ = 0;  // packed, alignment included
  std::size_t pinned_ranges_ = 0;
  std::size_t pinned_asked_ = 0;  // bytes asked for
  std::vector<slot_state> slots_;
  bool closed_ = false;
  std::vector<size_class> classes_;
  std::vector<class_granule> shared_;
  std::size_t slot_bytes_ = 0;  // asked for by the mapped slots
  std::size_t live_slots_ = 0;
};

}  // namespace taskswap::detail
