// SPDX-License-Identifier: Apache-2.0
// The disk home tier: every home in a unit file on a local drive, behind the host cache (Note
// [Home tiers], Note [Host cache], Note [Unit files]). A copy to or from the device goes through
// the unit's cache block, read from its file first on a miss.

#include "runtime/home_tier.hpp"

namespace taskswap::detail {

namespace {

std::size_t disk_pinned_bytes(std::size_t /*bytes*/) { return 0; }  // the host cache is sized once

void disk_place(home_store& store, unit_home& home, const home_request& request)
{
  home.cache = &*store.cache;
  home.entry = store.cache->add(request.unit, request.identity, request.bytes);
  home.bytes = request.bytes;
}

void disk_stage_in(const unit_home& home, std::size_t offset, device_span dst, stream_view s)
{
  const std::span<std::byte> block = home.cache->block(home.entry);
  copy_async(dst, std::span<const std::byte>(block.subspan(offset, dst.size())), s);
  home.cache->used(home.entry, &s, false);
}

void disk_write_back(const unit_home& home, std::size_t offset, const_device_span src, stream_view s)
{
  // A write-back of the whole home (device placement) needs nothing from the file; a part of it
  // (host placement's gradients) keeps the rest as the file has it.
  const bool whole = offset == 0 && src.size() >= home.bytes;
  const std::span<std::byte> block = home.cache->block(home.entry, whole);
  copy_async(block.subspan(offset, src.size()), src, s);
  home.cache->used(home.entry, &s, true);
}

std::span<std::byte> disk_block(const unit_home& home) { return home.cache->block(home.entry).first(home.bytes); }

bool disk_ready(const unit_home& home) { return home.cache->ready(home.entry); }

void disk_used(const unit_home& home, const stream_view* s, bool wrote) { home.cache->used(home.entry, s, wrote); }

}  // namespace

extern const home_tier disk_home_tier;
const home_tier disk_home_tier{.name = "disk",
                               .pinned_bytes = disk_pinned_bytes,
                               .place = disk_place,
                               .stage_in = disk_stage_in,
                               .write_back = disk_write_back,
                               .host_block = disk_block,
                               .ready = disk_ready,
                               .used = disk_used};

}  // namespace taskswap::detail
