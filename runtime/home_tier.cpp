// SPDX-License-Identifier: Apache-2.0
// The table of home tiers: Note [Home tiers] in runtime/home_tier.hpp.

#include "runtime/home_tier.hpp"

#include "device/message.hpp"

#include <array>

namespace taskswap::detail {

extern const home_tier host_home_tier;  // home_tier_host.cpp
extern const home_tier disk_home_tier;  // home_tier_disk.cpp

namespace {

// One row per tier.
constexpr std::array<const home_tier*, 2> home_tiers{&host_home_tier, &disk_home_tier};

}  // namespace

const home_tier& home_tier_named(std::string_view name)
{
  for (const home_tier* t : home_tiers) {
    if (t->name == name) { return *t; }
  }
  throw config_error(message("home \"", name, "\" is not a home tier; the tiers are ", home_tier_names()));
}

std::string home_tier_names()
{
  std::string out;
  for (const home_tier* t : home_tiers) { out += message(out.empty() ? "" : ", ", "\"", t->name, "\""); }
  return out;
}

void setup_homes(home_store& store, const device& dev, std::size_t bytes, const host_options& host,
                 const storage_options& storage, bool disk)
{
  if (disk && (storage.path.empty() || storage.host_cache == 0)) {
    throw config_error(message("units have home = \"disk\" but [storage] ",
                               storage.path.empty() ? "path" : "host_cache",
                               " is missing; give the directory of the unit files on a local drive and the pinned "
                               "host memory that caches them, e.g. [storage] path = \"/nvme/taskswap\", "
                               "host_cache = \"64 GiB\""));
  }
  constexpr std::size_t page = 4096;
  const std::size_t cache_bytes = disk ? (storage.host_cache + page - 1) / page * page : 0;
  pinned_arena_options o;
  o.bytes = bytes + (disk ? cache_bytes + page : 0);  // a page for the cache's alignment
  o.numa_node = host.numa_node;
  o.huge_pages = host.huge_pages;
  store.arena.emplace(dev, o);
  if (!disk) { return; }
  store.files.emplace(
    unit_file_options{.directory = storage.path,
                      .queue_depth = storage.queue_depth,
                      .block_bytes = storage.block,
                      .timeout = storage.timeout},
    io_faults{
      .fail_request = storage.fail_request, .fail_errno = storage.fail_errno, .short_request = storage.short_request});
  const std::span<std::byte> cache = store.arena->allocate(cache_bytes, page);
  store.files->register_buffers(cache);
  store.cache.emplace(dev, cache, *store.files);
}

std::uint64_t home_identity(std::string_view text)
{
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, 64 bits
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace taskswap::detail
