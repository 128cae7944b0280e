// SPDX-License-Identifier: Apache-2.0
// The disk home tier: every home in a unit file on a local drive, behind the host cache (Note
// [Home tiers], Note [Host cache], Note [Unit files]). A copy to or from the device goes through
// the unit's cache block, read from its file first on a miss.

#include "runtime/homes/home_tier.hpp"

#include "device/message.hpp"
#include "numeric/align.hpp"

namespace taskswap::detail {

namespace {

constexpr std::size_t page = 4096;

std::size_t disk_pinned_bytes(std::size_t /*bytes*/) { return 0; }  // the host cache is sized once

// The host cache, and a page for its alignment.
// The host cache, and a page for its alignment; refuses a [storage] table without what the tier
// needs before any memory is taken.
std::size_t disk_store_bytes(const storage_options& storage)
{
  if (storage.path.empty() || storage.host_cache == 0) {
    throw config_error(message("units have home = \"disk\" but [storage] ",
                               storage.path.empty() ? "path" : "host_cache",
                               " is missing; give the directory of the unit files on a local drive and the pinned "
                               "host memory that caches them, e.g. [storage] path = \"/nvme/taskswap\", "
                               "host_cache = \"64 GiB\""));
  }
  return round_up(storage.host_cache, page) + page;
}

void disk_open_store(home_store& store, const device& dev, const storage_options& storage)
{
  store.files.emplace(
    unit_file_options{.directory = storage.path,
                      .queue_depth = storage.queue_depth,
                      .block_bytes = storage.block,
                      .timeout = storage.timeout},
    io_faults{
      .fail_request = storage.fail_request, .fail_errno = storage.fail_errno, .short_request = storage.short_request});
  const std::span<std::byte> cache = store.arena->allocate(round_up(storage.host_cache, page), page);
  store.files->register_buffers(cache);
  store.cache.emplace(dev, cache, *store.files);
}

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
                               .cached = true,
                               .store_bytes = disk_store_bytes,
                               .open_store = disk_open_store,
                               .pinned_bytes = disk_pinned_bytes,
                               .place = disk_place,
                               .stage_in = disk_stage_in,
                               .write_back = disk_write_back,
                               .host_block = disk_block,
                               .ready = disk_ready,
                               .used = disk_used};

}  // namespace taskswap::detail
