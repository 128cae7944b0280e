// SPDX-License-Identifier: Apache-2.0
// The table of home tiers: Note [Home tiers] in runtime/home_tier.hpp.

#include "runtime/home_tier.hpp"

#include "device/message.hpp"

#include <array>

namespace taskswap::detail {

extern const home_tier host_home_tier;  // home_tier_host.cpp

namespace {

// One row per tier.
constexpr std::array<const home_tier*, 1> home_tiers{&host_home_tier};

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

void setup_homes(home_store& store, const device& dev, std::size_t bytes, int node, bool huge_pages)
{
  pinned_arena_options o;
  o.bytes = bytes;
  o.numa_node = node;
  o.huge_pages = huge_pages;
  store.arena.emplace(dev, o);
}

}  // namespace taskswap::detail
