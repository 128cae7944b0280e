// SPDX-License-Identifier: Apache-2.0
#include "device/best_fit_ranges.hpp"

namespace taskswap::detail {

best_fit_ranges::best_fit_ranges(std::size_t capacity, std::uintptr_t base_address)
    : capacity_(capacity), base_address_(base_address)
{
  if (capacity > 0) { insert_free(0, capacity); }
}

std::optional<std::size_t> best_fit_ranges::allocate(std::size_t bytes, std::size_t alignment)
{
  for (auto it = free_by_size_.lower_bound({bytes, 0}); it != free_by_size_.end(); ++it) {
    const auto [block_size, block_offset] = *it;
    const std::uintptr_t start = base_address_ + block_offset;
    const std::size_t padding = (alignment - start % alignment) % alignment;
    const std::size_t taken = padding + bytes;
    if (taken > block_size) { continue; }
    erase_free(free_by_offset_.find(block_offset));
    if (taken < block_size) { insert_free(block_offset + taken, block_size - taken); }
    live_.emplace(block_offset + padding, extent{block_offset, taken, bytes});
    used_ += taken;
    return block_offset + padding;
  }
  return std::nullopt;
}

bool best_fit_ranges::deallocate(std::size_t offset, std::size_t bytes)
{
  const auto found = live_.find(offset);
  if (found == live_.end() || found->second.size != bytes) { return false; }
  const extent e = found->second;
  live_.erase(found);
  used_ -= e.block_size;
  insert_free(e.block_offset, e.block_size);
  return true;
}

bool best_fit_ranges::shrink(std::size_t offset, std::size_t bytes, std::size_t keep)
{
  const auto found = live_.find(offset);
  if (found == live_.end() || found->second.size != bytes || keep == 0 || keep >= bytes) { return false; }
  extent& e = found->second;
  const std::size_t kept_block = offset - e.block_offset + keep;
  const std::size_t tail = e.block_size - kept_block;
  e.block_size = kept_block;
  e.size = keep;
  used_ -= tail;
  insert_free(e.block_offset + kept_block, tail);
  return true;
}

void best_fit_ranges::insert_free(std::size_t offset, std::size_t size)
{
  // Coalesce with the free neighbours on both sides.
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && offset + size == next->first) {
    size += next->second;
    erase_free(next);
  }
  auto prev = free_by_offset_.lower_bound(offset);
  if (prev != free_by_offset_.begin()) {
    --prev;
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void best_fit_ranges::erase_free(std::map<std::size_t, std::size_t>::iterator it)
{
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

}  // namespace taskswap::detail
