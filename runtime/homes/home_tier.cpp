// SPDX-License-Identifier: Apache-2.0
// The table of home tiers: Note [Home tiers] in runtime/homes/home_tier.hpp.

#include "runtime/homes/home_tier.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"

#include <mutex>
#include <vector>

namespace taskswap::detail {

extern const home_tier host_home_tier;  // home_tier_host.cpp
extern const home_tier disk_home_tier;  // home_tier_disk.cpp

namespace {

// One row per tier; add_home_tier() appends more.
std::vector<const home_tier*>& home_tiers()
{
  static std::vector<const home_tier*> tiers{&host_home_tier, &disk_home_tier};
  return tiers;
}

std::mutex& home_tiers_mutex()
{
  static std::mutex m;
  return m;
}

std::string home_tier_names_locked()
{
  std::string out;
  for (const home_tier* t : home_tiers()) { out += message(out.empty() ? "" : ", ", "\"", t->name, "\""); }
  return out;
}

}  // namespace

const home_tier& home_tier_named(std::string_view name)
{
  const std::scoped_lock lock(home_tiers_mutex());
  for (const home_tier* t : home_tiers()) {
    if (t->name == name) { return *t; }
  }
  throw config_error(message("home \"", name, "\" is not a home tier; the tiers are ", home_tier_names_locked()));
}

std::string home_tier_names()
{
  const std::scoped_lock lock(home_tiers_mutex());
  return home_tier_names_locked();
}

void add_home_tier(const home_tier& tier)
{
  TASKSWAP_EXPECTS(tier.store_bytes && tier.open_store && tier.pinned_bytes && tier.place && tier.stage_in &&
                     tier.write_back && tier.host_block && tier.ready && tier.used,
                   message("the home tier \"", tier.name, "\" leaves a slot empty; fill every one"));
  const std::scoped_lock lock(home_tiers_mutex());
  for (const home_tier* t : home_tiers()) {
    TASKSWAP_EXPECTS(t->name != tier.name, message("a home tier named \"", tier.name, "\" exists already"));
  }
  home_tiers().push_back(&tier);
}

void setup_homes(home_store& store, const device& dev, std::size_t bytes, const host_options& host,
                 const storage_options& storage, std::span<const home_tier* const> used)
{
  pinned_arena_options o;
  o.bytes = bytes;
  for (const home_tier* t : used) { o.bytes += t->store_bytes(storage); }
  o.numa_node = host.numa_node;
  o.huge_pages = host.huge_pages;
  store.arena.emplace(dev, o);
  for (const home_tier* t : used) { t->open_store(store, dev, storage); }
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

bool taskswap::home_is_cached(const unit_policy& p) { return detail::home_tier_named(p.home).cached; }
