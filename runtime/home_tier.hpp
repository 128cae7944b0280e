// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where a unit's home copy lives.
//
// Note [Home tiers]: a tier is one row of function slots, as NCCL's transports are
// (src/transport.cc lists {&p2pTransport, &shmTransport, &netTransport}, each filled in a file of
// its own). Everything the runtime does with a home copy goes through its unit's tier:
// - stage_in:   a range of the home copy to the device (a swap-in, a parameter upload, the
//               initial broadcast's staging), enqueued on a stream;
// - write_back: a range from the device into the home copy (a write-back, gradients or state
//               tensors home, a broadcast received), enqueued on a stream;
// - host_block: the home copy as host memory, for the CPU AdamW, checkpoints, replica checks and
//               the public home() view.
// Adding a tier is one file that fills a home_tier and one row in home_tiers (home_tier.cpp); a
// unit takes the tier its policy names (unit_policy::home, [[units]] home = "..."). The host tier
// (home_tier_host.cpp) keeps every home in the pinned, NUMA-local arena of home_store.

#include <taskswap/device.hpp>
#include <taskswap/host.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace taskswap::detail {

struct home_tier;

/// A unit's home copy: its tier, and where the tier keeps it.
struct unit_home {
  const home_tier* tier = nullptr;
  std::byte* block = nullptr;  // the host tier: the unit's block in the pinned arena
  std::size_t bytes = 0;  // the block's size (the layout's home_bytes)
};

/// What the tiers keep for the runtime: the pinned, NUMA-local arena every host home (and the
/// runtime's own pinned buffers) lies in.
struct home_store {
  std::optional<pinned_arena> arena;
};

struct home_tier {
  std::string_view name;  // as [[units]] home = "..." names it
  /// The pinned host memory (of store.arena) a home of `bytes` takes in this tier.
  std::size_t (*pinned_bytes)(std::size_t bytes);
  /// Reserves `home`'s block of `bytes` in `store`, whose arena has what pinned_bytes() asked.
  /// @throws out_of_memory, config_error
  void (*place)(home_store& store, unit_home& home, std::size_t bytes);
  /// Enqueues on `s` the copy of home bytes [offset, offset + dst.size()) to `dst`. Does not synchronise.
  void (*stage_in)(const unit_home& home, std::size_t offset, device_span dst, stream_view s);
  /// Enqueues on `s` the copy of `src` into home bytes [offset, offset + src.size()). Does not synchronise.
  void (*write_back)(const unit_home& home, std::size_t offset, const_device_span src, stream_view s);
  /// The home copy as host memory. Current once the work enqueued on it is done.
  std::span<std::byte> (*host_block)(const unit_home& home);
};

/// The tier named `name`.
/// @throws config_error naming the tiers there are
[[nodiscard]] const home_tier& home_tier_named(std::string_view name);

/// The names of the tiers, for messages ("host").
[[nodiscard]] std::string home_tier_names();

/// Makes `store`'s arena of `bytes` (what the tiers' pinned_bytes() ask and the runtime's own
/// pinned buffers) on `node` (-1: the device's local node).
void setup_homes(home_store& store, const device& dev, std::size_t bytes, int node, bool huge_pages);

}  // namespace taskswap::detail
