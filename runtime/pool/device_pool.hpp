// SPDX-License-Identifier: Apache-2.0
#pragma once

// The device pool: the device bytes the runtime may use. It takes the budget from the backend at
// construction as physical memory (whole granules of the budget; the rest is never taken) and maps
// it into address ranges with the backend's virtual memory calls, so a range's bytes need not be
// contiguous in physical memory and free room never splits: any request of at most the free
// granules is met (DESIGN invariant 8). Every resident slab and staging buffer comes out of it, so
// device bytes held never exceed the budget (invariant 1).
//
// - Physical memory is a set of extents: each one handle of whole granules, mapped whole. What a
//   driver call costs goes by the handle, not the bytes (Note [Extents]), so a slot takes one
//   extent of its size, or two where a later shrink() keeps a prefix. An extent of the size asked
//   for is reused as it is; otherwise free extents are released and one of that size is made from
//   them (a reshape).
// - Pinned ranges are packed one after another (256-byte aligned) into one region whose extents
//   are mapped as it grows and never given back.
// - Every other range is a slot: an address range reserved once, of its largest size, that keeps
//   its address for the pool's life. Unmapping a slot frees its extents at once (the caller
//   orders their reuse after the slot's last use) but leaves them mapped there, so mapping it again
//   while they are still free needs no call. Only when they were taken does the slot move to
//   others; an extent may stay mapped at several slots (only its owner uses it). When a slot
//   maps an extent that others still map, their mappings of it (and of the extents after it
//   there) are unmapped in a deferred job (Note [Deferred unmaps]).
// - A slot of at most half a granule is packed: it takes a place in a granule shared with slots
//   of its size class (granule / k bytes, 256-byte aligned, k places per granule). A class granule
//   is given back when its last place empties, and stays mapped where it was, as a slot does.
//   Packed slots cost a granule each at most, so a check that charges them a granule is sound;
//   units resident but not held fill granules k at a time.
// - The driver calls run on the pool's mapping thread (slot_mapper), in the order the pool decides
//   them (deferred unmaps excepted, Note [Deferred unmaps]): a map returns the range at once with a ticket, and the range may be used once ready()
//   says the ticket is done (Note [Mapping off the trainer's thread]). What moves waits there,
//   not on the caller's thread, for a fence after the addresses' earlier users.
//
// Not thread-safe: one thread (the runtime's caller) uses it. docs/runtime.md gives the design.

#include "runtime/residency/residency_model.hpp"
#include "runtime/pool/slot_mapper.hpp"

#include <taskswap/device.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
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
  std::size_t extents = 0;  // physical handles held now
  std::size_t reshapes = 0;  // extents made from others since construction
  std::size_t mapping_jobs = 0;  // batches of driver calls queued since construction
  std::size_t deferred_jobs = 0;  // of stale mappings' unmaps (Note [Deferred unmaps]), not among them
};

class device_pool {
 public:
  using slot_id = std::uint32_t;
  using ticket = slot_mapper::ticket;

  /// Takes the whole granules of `budget` from `dev`. `timeout` bounds the mapping thread's wait
  /// for the earlier users of what moves.
  /// @throws invalid_argument for a budget smaller than one granule
  /// @throws out_of_memory when the device cannot hold the budget, with what it has free
  device_pool(const device& dev, std::size_t budget,
              std::chrono::milliseconds timeout = std::chrono::milliseconds{300'000});
  /// Prints what close() found, if close() was not called.
  ~device_pool();
  /// Waits for the mapping thread and the device, then undoes what the mapping thread's calls did
  /// (every mapping, every handle) and frees the addresses; returns what went wrong (the mapping
  /// thread's failure, a faulted device's error, an unmap that failed: then the addresses stay
  /// reserved) for the owner to report once with its own. Never throws; the pool is unusable after.
  [[nodiscard]] std::vector<std::string> close() noexcept;
  device_pool(const device_pool&) = delete;
  device_pool& operator=(const device_pool&) = delete;
  device_pool(device_pool&&) = delete;
  device_pool& operator=(device_pool&&) = delete;

  [[nodiscard]] std::size_t granule() const noexcept { return granule_; }
  /// The bytes a range of `bytes` takes: whole granules.
  [[nodiscard]] std::size_t taken(std::size_t bytes) const noexcept { return whole_granules(bytes, granule_); }
  /// The bytes of the free granules.
  [[nodiscard]] std::size_t free() const noexcept { return free_granules_ * granule_; }

  /// A range of `bytes` (256-byte aligned) that stays mapped for the pool's life; usable on return.
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

  /// Called with each slot whose earlier users must be done before addresses it used move: makes
  /// `fence` wait for those users' work still in flight, and returns who they are (for a timeout's
  /// message), or an empty string where nothing is in flight.
  using quiesce_fn = std::function<std::string(slot_id, stream_view fence)>;
  /// A mapped range and the ticket after which it may be used (0: at once).
  struct mapping {
    device_span range;
    ticket ready = 0;
  };
  /// Whether mapping `bytes` at the unmapped slot would succeed now.
  [[nodiscard]] bool fits(slot_id slot, std::size_t bytes) const;
  /// Maps `bytes` at the unmapped slot; nothing (and no change) when it does not fit. A later
  /// shrink() may keep `keep` bytes (0: none): the slot's extents then part there.
  [[nodiscard]] std::optional<mapping> try_map(slot_id slot, std::size_t bytes, std::size_t keep,
                                               const quiesce_fn& quiesce);
  /// As try_map(), but out_of_memory naming the budget and the bytes in use.
  [[nodiscard]] mapping map(slot_id slot, std::size_t bytes, std::size_t keep, const quiesce_fn& quiesce);
  /// Whether the mapped slot `a` holds an extent that slot `b` still maps (or mapped before: the
  /// unmap is deferred), and each such extent lies at the same offset in both ranges (so where a
  /// copy out of `b`'s range and one into `a`'s touch the same memory, they do at the same
  /// offsets; Note [Extents]).
  [[nodiscard]] bool shares_aligned(slot_id a, slot_id b) const;
  /// The other slots that still map an extent the mapped slot `s` holds, or mapped it since it
  /// was last given back (their earlier uses of it must be done before `s` writes it), into
  /// `out`. False where that cannot be told by slot (a packed slot, or an extent a class granule
  /// had): then every earlier user counts.
  [[nodiscard]] bool sharers(slot_id s, std::vector<slot_id>& out) const;
  /// Whether the mapping of `t` is done. @throws the mapping thread's failure
  [[nodiscard]] bool ready(ticket t) { return t == 0 || mapper_.ready(t); }
  /// Blocks until the mapping of `t` is done. @throws the mapping thread's failure
  void wait(ticket t)
  {
    if (t != 0) { mapper_.wait(t); }
  }
  /// @throws the mapping thread's failure, if one happened
  void check() { static_cast<void>(mapper_.ready(0)); }
  /// Frees the slot's extents. The caller orders their reuse after the slot's last use.
  void unmap(slot_id slot);
  /// Keeps the first `bytes` of the mapped slot (as mapped with `keep` = `bytes`, or with its
  /// extents parting there) and frees the extents past them; returns the kept range. The caller
  /// orders the freed extents' reuse as for unmap().
  [[nodiscard]] device_span shrink(slot_id slot, std::size_t bytes);
  /// Unmaps the slot and gives back its addresses; no work may use it any more.
  void remove_slot(slot_id slot);

  [[nodiscard]] device_pool_stats stats() const;
  [[nodiscard]] const device& get_device() const noexcept { return dev_; }

 private:
  static constexpr std::uint32_t none = ~std::uint32_t{0};
  static constexpr std::uint32_t pinned_owner = none - 1;
  static constexpr std::uint32_t class_site = std::uint32_t{1} << 31;  // a site index with this bit: a class granule
  struct extent {
    std::size_t granules = 0;
    std::uint32_t owner = none;  // the site that owns it (pinned_owner: the pinned region); none: free
    std::vector<std::uint32_t> sites;  // where it is mapped, its owner's included (never the pinned region)
    // Where it was mapped before, unmapped in a deferred job since it was last given back, and at
    // which granule there: their users are still earlier users of its memory.
    std::vector<std::pair<std::uint32_t, std::size_t>> former;
    bool live = false;
  };
  struct slot_state {
    std::byte* address = nullptr;  // packed: nullptr (its place's address while mapped)
    std::size_t max_granules = 0;
    std::vector<std::uint32_t> mapped;  // extents at address, in order; the first `owned` are its own
    std::size_t owned = 0;
    std::size_t bytes = 0;  // asked for by the live mapping
    bool live = false;
    bool removed = false;
    std::uint32_t size_class = none;  // packed: its class
    std::uint32_t shared = none;  // packed and mapped: its class granule ...
    std::uint32_t place = 0;  // ... and its place there
    ticket ready = 0;  // the last job that mapped extents here
  };
  // A granule shared by the packed slots of one class: its addresses reserved once; an extent of
  // one granule mapped there while any place is taken, and left mapped (stale) when it empties.
  struct class_granule {
    std::byte* address = nullptr;
    std::uint32_t extent = none;  // mapped at address
    std::vector<slot_id> places;  // the slot in each place, or none
    std::size_t taken = 0;  // places taken: while any is, the extent is its own
    std::vector<slot_id> former;  // slots that used it since its extent was mapped
    ticket ready = 0;  // the job that mapped its extent
  };
  struct size_class {
    std::size_t place_bytes = 0;
    std::vector<std::uint32_t> granules;  // into shared_
  };
  // The driver calls of one map, and the slots whose earlier users they wait for.
  struct job_builder {
    slot_mapper::job job;
    std::vector<std::uint32_t> quiesced;  // sites whose users the fence waits for
    bool deferred = false;  // its fence on the deferred jobs' stream, so no other job waits for it
  };

  [[nodiscard]] static std::size_t round256(std::size_t bytes) noexcept { return (bytes + 255) / 256 * 256; }
  [[nodiscard]] std::uint32_t class_of(std::size_t bytes);
  [[nodiscard]] std::uint32_t open_place(const size_class& c) const;  // a class granule with a free place, or none
  [[nodiscard]] bool has_room(const slot_state& s, std::size_t bytes) const;
  [[noreturn]] void throw_full(std::size_t bytes, const char* what) const;
  [[nodiscard]] mapping map_slot(slot_id id, slot_state& s, std::size_t bytes, std::size_t keep,
                                 const quiesce_fn& quiesce);
  [[nodiscard]] mapping map_packed(slot_id id, slot_state& s, std::size_t bytes, const quiesce_fn& quiesce);
  [[nodiscard]] device_span mapped(slot_state& s, std::size_t bytes, std::byte* at);
  [[nodiscard]] bool reuses_mapped(slot_state& s, std::size_t need, std::size_t split);
  void unmap_packed(slot_state& s);
  [[nodiscard]] slot_state& live_slot(slot_id slot, const char* call);
  // Extents: the free ones by size, taking and giving them, making one of a size, moving them.
  [[nodiscard]] std::uint32_t new_extent_id(std::size_t granules);
  [[nodiscard]] std::uint32_t extent_of(std::size_t granules, job_builder& b, const quiesce_fn& quiesce);
  void take(std::uint32_t e, std::uint32_t owner);
  void give(std::uint32_t e);
  void quiesce_site(std::uint32_t site, job_builder& b, const quiesce_fn& quiesce);
  void unmap_site_from(std::uint32_t site, std::size_t index, job_builder& b, const quiesce_fn& quiesce);
  void replace_mapped(slot_id id, std::size_t index, std::size_t at, job_builder& b, const quiesce_fn& quiesce);
  void detach(std::uint32_t e, job_builder& b, const quiesce_fn& quiesce);
  void map_at(std::byte* address, std::uint32_t e, std::uint32_t site, job_builder& b);
  void unmap_stale(std::uint32_t e, std::uint32_t owner, job_builder& tidy, const quiesce_fn& quiesce);
  [[nodiscard]] stream& fences(const job_builder& b) noexcept { return b.deferred ? deferred_fences_ : fences_; }
  void fence(job_builder& b);
  [[nodiscard]] ticket submit(job_builder& b);
  void defer(job_builder& b);
  void note_peak();

  device dev_;
  std::size_t budget_;
  std::size_t granule_;
  std::size_t granules_;
  std::vector<extent> extents_;
  std::vector<std::uint32_t> spare_ids_;  // ids of released extents, for reuse
  std::set<std::pair<std::size_t, std::uint32_t>> free_extents_;  // (granules, id)
  std::size_t free_granules_ = 0;
  std::size_t live_extents_ = 0;
  std::size_t reshapes_ = 0;
  std::size_t jobs_ = 0;
  std::size_t deferred_ = 0;
  std::size_t peak_ = 0;
  // The pinned region: reserved for the whole capacity, mapped as it grows.
  std::byte* pinned_address_ = nullptr;
  std::vector<std::uint32_t> pinned_extents_;
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
  stream fences_;  // waits for the earlier users of what a job moves (quiesce_fn)
  stream deferred_fences_;  // the same for deferred jobs
  slot_mapper mapper_;  // last: its thread stops first
};

}  // namespace taskswap::detail
