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
//               the public home() view;
// - ready:      whether stage_in would start at once (a disk home's read is done), so that the
//               device prefetch never waits for the drive;
// - used:       work on a stream (or the host, done) used the host_block, and whether it wrote it.
//               The runtime says so at once after taking a host_block, before touching another
//               home: a tier whose host memory is a cache must not reuse that block until then.
// - store_bytes, open_store: what the tier shares among its homes (the disk tier's files and
//               host cache), sized and made once, only when some unit uses the tier.
// - cached:     its homes are read through the host cache: home() views last until the next
//               call, the plan reads them [storage] lookahead steps ahead, the planner replays
//               the cache for them.
// Adding a tier is one file that fills a home_tier and one row in home_tiers (home_tier.cpp), or
// one add_home_tier() call (tests/runtime/home_tier_test.cpp adds a tier so); a unit takes the
// tier its policy names (unit_policy::home, [[units]] home = "..."). No tier's name is compared
// outside its own file. The host tier (home_tier_host.cpp) keeps every home in the pinned,
// NUMA-local arena of home_store; the disk tier (home_tier_disk.cpp) keeps it in a unit file,
// behind the host cache (Note [Host cache]).

#include "storage/host_cache.hpp"
#include "storage/unit_files.hpp"

#include <taskswap/device.hpp>
#include <taskswap/host.hpp>
#include <taskswap/runtime.hpp>

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
  host_cache* cache = nullptr;  // the disk tier: the cache in front of the unit's file
  host_cache::entry_id entry = 0;
};

/// What a tier places: the unit's name and identity (what its tensors are) and its home's bytes.
struct home_request {
  std::string_view unit;
  std::uint64_t identity = 0;
  std::size_t bytes = 0;
};

/// What the tiers keep for the runtime: the pinned, NUMA-local arena every host home (and the
/// runtime's own pinned buffers, and the host cache) lies in; the disk tier's files and cache.
struct home_store {
  std::optional<pinned_arena> arena;
  std::optional<unit_files> files;
  std::optional<host_cache> cache;
};

struct home_tier {
  std::string_view name;  // as [[units]] home = "..." names it
  bool cached = false;  // its homes are read through the host cache (see the Note)
  /// The pinned host memory (of store.arena) the tier's shared parts take, once (0: none).
  /// @throws config_error when the configuration lacks what the tier needs (before any is taken)
  std::size_t (*store_bytes)(const storage_options& storage);
  /// Makes the tier's shared parts in `store`, whose arena has what store_bytes() asked (called
  /// once, before any place(), when a unit uses the tier).
  /// @throws storage_error
  void (*open_store)(home_store& store, const device& dev, const storage_options& storage);
  /// The pinned host memory (of store.arena) a home of `bytes` takes in this tier.
  std::size_t (*pinned_bytes)(std::size_t bytes);
  /// Places `home` in `store`, whose arena has what pinned_bytes() asked.
  /// @throws out_of_memory, config_error, storage_error
  void (*place)(home_store& store, unit_home& home, const home_request& request);
  /// Enqueues on `s` the copy of home bytes [offset, offset + dst.size()) to `dst`. Does not synchronise.
  void (*stage_in)(const unit_home& home, std::size_t offset, device_span dst, stream_view s);
  /// Enqueues on `s` the copy of `src` into home bytes [offset, offset + src.size()). Does not synchronise.
  void (*write_back)(const unit_home& home, std::size_t offset, const_device_span src, stream_view s);
  /// The home copy as host memory. Current once the work enqueued on it is done.
  std::span<std::byte> (*host_block)(const unit_home& home);
  /// Whether stage_in() would not wait (the home is in host memory). Never waits.
  bool (*ready)(const unit_home& home);
  /// Work enqueued on `s` (nullptr: the host, done) used host_block(home); `wrote`: changed it.
  void (*used)(const unit_home& home, const stream_view* s, bool wrote);
};

/// The tier named `name`.
/// @throws config_error naming the tiers there are
[[nodiscard]] const home_tier& home_tier_named(std::string_view name);

/// The names of the tiers, for messages ("host").
[[nodiscard]] std::string home_tier_names();

/// Adds a tier to the table (its name not taken yet), for the life of the process.
/// @throws invalid_argument when a tier of that name exists
void add_home_tier(const home_tier& tier);

/// Makes `store`'s arena of `bytes` (what the tiers' pinned_bytes() ask and the runtime's own
/// pinned buffers) and what each tier in `used` shares (store_bytes(), open_store()), on the
/// host's NUMA node.
/// @throws config_error when a tier lacks its configuration
void setup_homes(home_store& store, const device& dev, std::size_t bytes, const host_options& host,
                 const storage_options& storage, std::span<const home_tier* const> used);

/// A unit's identity for its disk file: a hash of its layout (tensors, dtypes, sizes).
[[nodiscard]] std::uint64_t home_identity(std::string_view text);

}  // namespace taskswap::detail
