// SPDX-License-Identifier: Apache-2.0
#include "runtime/device_pool.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"

#include <algorithm>

namespace taskswap::detail {

namespace {

device_buffer take_budget(const device& dev, std::size_t budget)
{
  TASKSWAP_EXPECTS(budget > 0, "device pool budget of 0 bytes; set [device] budget");
  try {
    return device_buffer(dev, budget);
  } catch (const out_of_memory& e) {
    throw out_of_memory(message("the device budget of ", bytes_text(budget), " does not fit on ", dev.name(),
                                ", which has ", bytes_text(e.available()), " free of ", bytes_text(e.budget()),
                                "; lower [device] budget (", e.what(), ")"),
                        budget, e.available(), e.budget());
  }
}

}  // namespace

device_pool::device_pool(const device& dev, std::size_t budget)
    : memory_(take_budget(dev, budget)),
      ranges_(budget, reinterpret_cast<std::uintptr_t>(memory_.data()))  // NOLINT: alignment of real addresses
{
}

std::optional<device_span> device_pool::try_allocate(std::size_t bytes, std::size_t alignment)
{
  TASKSWAP_EXPECTS(bytes > 0, "device pool allocation of 0 bytes");
  TASKSWAP_EXPECTS(alignment >= 256 && (alignment & (alignment - 1)) == 0,
                   message("device pool alignment must be a power of two of at least 256, got ", alignment));
  const std::lock_guard lock(mutex_);
  if (const auto offset = ranges_.allocate(bytes, alignment)) {
    peak_ = std::max(peak_, ranges_.used());
    return memory_.span(*offset, bytes);
  }
  return std::nullopt;
}

device_span device_pool::allocate(std::size_t bytes, std::size_t alignment)
{
  if (auto range = try_allocate(bytes, alignment)) { return *range; }
  const std::lock_guard lock(mutex_);
  const std::size_t budget = ranges_.capacity();
  throw out_of_memory(message("device pool on ", get_device().name(), ": no free block holds ", bytes_text(bytes),
                              "; ", bytes_text(budget - ranges_.used()), " of the ", bytes_text(budget),
                              " budget free, the largest block ", bytes_text(ranges_.largest_free())),
                      bytes, budget - ranges_.used(), budget);
}

void device_pool::deallocate(device_span range)
{
  const std::lock_guard lock(mutex_);
  const std::byte* base = memory_.data();
  const bool inside = range.owner() == &get_device().backend() && range.data() >= base &&
                      range.data() < base + memory_.size();
  TASKSWAP_EXPECTS(inside && ranges_.deallocate(static_cast<std::size_t>(range.data() - base), range.size()),
                   message("device pool: ", range.size(), " bytes at ", static_cast<const void*>(range.data()),
                           " is not a live allocation of this pool"));
}

device_span device_pool::shrink(device_span range, std::size_t bytes)
{
  const std::lock_guard lock(mutex_);
  const std::byte* base = memory_.data();
  const bool inside = range.owner() == &get_device().backend() && range.data() >= base &&
                      range.data() < base + memory_.size();
  TASKSWAP_EXPECTS(bytes > 0 && inside && ranges_.shrink(static_cast<std::size_t>(range.data() - base), range.size(), bytes),
                   message("device pool: cannot keep ", bytes, " bytes of ", range.size(), " at ",
                           static_cast<const void*>(range.data()), ": not a live allocation of this pool larger than that"));
  return range.subspan(0, bytes);
}

device_pool_stats device_pool::stats() const
{
  const std::lock_guard lock(mutex_);
  return {ranges_.capacity(), ranges_.used(), peak_, ranges_.largest_free(), ranges_.live()};
}

}  // namespace taskswap::detail
