// SPDX-License-Identifier: Apache-2.0
#pragma once

// Best-fit placement of aligned ranges inside one region of `capacity` bytes, with coalescing on
// release: the sub-allocator of the pinned arena (host/) and of the device pool (runtime/). It
// knows offsets only; the owner maps them to memory and serialises calls.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace taskswap::detail {

class best_fit_ranges {
 public:
  /// `base_address` is where offset 0 lives, so alignment is of the real address.
  best_fit_ranges(std::size_t capacity, std::uintptr_t base_address);

  /// The offset of a range of `bytes` aligned to `alignment` (a power of two), or nothing when
  /// no free block holds it. Alignment padding is charged to the range.
  [[nodiscard]] std::optional<std::size_t> allocate(std::size_t bytes, std::size_t alignment);
  /// Releases the range at `offset`; false (and nothing changes) unless it is a live range of
  /// exactly `bytes`.
  [[nodiscard]] bool deallocate(std::size_t offset, std::size_t bytes);
  /// Keeps the first `keep` bytes of the live range at `offset` and frees the rest; false (and
  /// nothing changes) unless it is a live range of exactly `bytes` and 0 < keep < bytes.
  [[nodiscard]] bool shrink(std::size_t offset, std::size_t bytes, std::size_t keep);

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t used() const noexcept { return used_; }
  [[nodiscard]] std::size_t live() const noexcept { return live_.size(); }
  [[nodiscard]] std::size_t free_blocks() const noexcept { return free_by_offset_.size(); }
  [[nodiscard]] std::size_t largest_free() const noexcept
  {
    return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  }

 private:
  struct extent {
    std::size_t block_offset;  // where the block starts (alignment padding first)
    std::size_t block_size;
    std::size_t size;  // bytes asked for
  };
  void insert_free(std::size_t offset, std::size_t size);
  void erase_free(std::map<std::size_t, std::size_t>::iterator it);

  std::size_t capacity_;
  std::uintptr_t base_address_;
  std::size_t used_ = 0;
  std::map<std::size_t, std::size_t> free_by_offset_;  // offset -> size
  std::set<std::pair<std::size_t, std::size_t>> free_by_size_;  // (size, offset)
  std::map<std::size_t, extent> live_;  // range offset -> extent
};

}  // namespace taskswap::detail
