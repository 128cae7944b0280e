// SPDX-License-Identifier: Apache-2.0
#pragma once

// The host cache in front of the disk home tier: pinned host memory holding the home blocks of
// the disk-homed units that were used last or are used next.
//
// Note [Host cache]:
// - A unit whose home is on disk has an entry: its unit file, and, while cached, a block of the
//   cache's memory holding the file's bytes (or newer ones: dirty).
// - A run starts its homes as zeros, as the host tier's arena does: an entry's first block() in
//   this run is zeroed, not read, whatever an earlier run left in its file (the trainer then
//   writes the initial values through home()). Later, block() reads the file on a miss (the
//   caller waits: back-pressure). The block stays valid until a later block() of another entry evicts it, so a
//   caller that enqueues work on the block says so at once with used(): eviction waits for that
//   work (events, one per stream), and a block written (wrote = true) is dirty. A dirty block the
//   runtime says is superseded (the unit's device copy has a newer update, which its write-back
//   will bring home whole) is let go unwritten: its bytes would be overwritten before being read.
//   Until that write-back arrives the entry is behind() (its block, read again, would be older
//   than the last write-back): the runtime refuses home() of such a unit after a failure, which
//   lost the device copy, rather than hand out older bytes.
// - prefetch() starts the read of an entry the plan uses soon, so that block() finds it there;
//   ready() says when the read is done (the device prefetch waits for it: a unit is in host
//   memory before its device copy starts).
// - Eviction takes the cached entry whose next use (next_use(): the runtime's plan, as the next
//   use that reads the block) is furthest, then one that needs no write, then the least recently
//   used: Belady's rule, as the device's. evict_before() is that rule; the planner's replay
//   applies it too. A superseded block counts as never used again, whatever its unit's next use:
//   that use finds the device copy, and the write-back that brings it home overwrites the block
//   unread. A dirty victim is written to its file before its memory is
//   reused, so nothing is lost between the tiers (DESIGN.md invariant 9); block() waits for that
//   write and for the work on the victim's block.
// - A prefetch takes free room, or the room of blocks that cost nothing to let go: next_use()
//   never (no use in the plan reads them), and clean or superseded. So it moves reads earlier and
//   adds no write, and no read but where next_use() was wrong (the runtime's never for a block
//   whose device copy serves its next use holds while that copy stays). Letting a block go that
//   a later use reads (even one Belady's rule would let go at the fetched entry's use) turned, on
//   the sample, into 5-17 % more bytes than on demand, because the write-backs that arrive before
//   that use are not in the plan. It waits for nothing: a victim's block comes free once no
//   stream uses it (pump()).
// - flush() writes every dirty block, zeroes the files of entries never used in this run, and
//   syncs the files it wrote: the files are then the homes (a checkpoint copies them).
// - discard() forgets an entry's block before the caller replaces its file (a checkpoint's load);
//   the entry's next block() reads the new file.
// - One thread owns a host_cache, as the runtime's calls are.

#include "storage/unit_files.hpp"

#include <taskswap/device.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string_view>

namespace taskswap::detail {

struct host_cache_stats {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;  // block() found the entry absent, or its prefetch's read not done
  std::uint64_t evictions = 0;
  std::uint64_t written_back = 0;  // dirty blocks written to their files (evictions and flushes)
  std::uint64_t prefetches = 0;  // reads started ahead of use by prefetch()
  double wait_seconds = 0;  // the caller's waits for reads and writes (block(), flush())
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::size_t used_bytes = 0;  // cached blocks now
};

/// A cached block as the eviction rule weighs it (Note [Host cache]).
struct cache_candidate {
  std::uint64_t next_use = 0;  ///< when the plan reads it next; `never` where none does, or it is superseded
  bool needs_write = false;  ///< dirty and not superseded: it must reach its file before it goes
  std::uint64_t last_used = 0;  ///< the tick of its last touch
  std::size_t id = 0;  ///< the last tie-break: the lower goes first
};

/// The host cache's eviction rule, which the cache and the planner's replay both apply: whether
/// `a` goes before `b`. The next use furthest (Belady's rule), then one that needs no write, then
/// the least recently used, then the lower id.
[[nodiscard]] constexpr bool evict_before(const cache_candidate& a, const cache_candidate& b) noexcept
{
  if (a.next_use != b.next_use) { return a.next_use > b.next_use; }
  if (a.needs_write != b.needs_write) { return !a.needs_write; }
  if (a.last_used != b.last_used) { return a.last_used < b.last_used; }
  return a.id < b.id;
}

class host_cache {
 public:
  using entry_id = std::uint32_t;
  static constexpr std::uint64_t never = std::numeric_limits<std::uint64_t>::max();

  /// Caches in `memory` (page-aligned pinned host memory that outlives this object, registered
  /// with `files`' ring by the caller if wanted) the homes kept in `files`.
  host_cache(const device& dev, std::span<std::byte> memory, unit_files& files);
  ~host_cache();
  host_cache(const host_cache&) = delete;
  host_cache& operator=(const host_cache&) = delete;

  /// Adds the home of unit `unit` (its file named by name and identity), of `bytes`.
  /// @throws storage_error when its file cannot be made
  /// @throws config_error when the cache cannot hold it at all
  entry_id add(std::string_view unit, std::uint64_t identity, std::size_t bytes);
  /// The position of the next use that reads an entry's block (never: none planned); the larger,
  /// the later.
  void next_use(std::function<std::uint64_t(entry_id)> when);
  /// Whether an entry's block is superseded: a newer copy of the whole home (a device copy with
  /// an update) will overwrite it before anything reads it. A superseded dirty block is let go
  /// without its write.
  void superseded(std::function<bool(entry_id)> when);

  /// The entry's block, read from its file first when it is not cached (unless the caller will
  /// `overwrite` all of it: then its bytes are undefined until written). Valid until the next
  /// block() of another entry.
  /// @throws storage_error when a read or a victim's write fails
  /// @throws out_of_memory when the entry does not fit beside the blocks that are in use
  [[nodiscard]] std::span<std::byte> block(entry_id e, bool overwrite = false);
  /// Starts bringing the entry into the cache ahead of its use, into free room or the room of
  /// blocks next_use() says nothing reads and that are clean or superseded (Note [Host cache]),
  /// which comes once no stream uses them. Returns false where there is no such room now (a prefetch in order stops).
  /// @throws storage_error when a read or write cannot be started
  bool prefetch(entry_id e);
  /// Whether the entry's block is cached and its read done (reaps completions, never waits).
  /// @throws storage_error when its read failed
  [[nodiscard]] bool ready(entry_id e);
  /// Ends the transfers that are done: a read's block is ready, an eviction's write frees it.
  /// @throws storage_error when one failed
  void pump();
  /// Work enqueued on `s` (nullptr: done by the host already) uses the block; `wrote`: it changes it.
  void used(entry_id e, const stream_view* s, bool wrote);
  /// Writes every dirty block to its file, zeroes the files of entries this run never used (their
  /// homes are zeros), and syncs the files written: the files are then the homes.
  /// @throws storage_error
  void flush();
  /// The caller is about to write the entry's file itself (a checkpoint's load): waits for the
  /// entry's transfer (its failure no longer matters) and the work on its block, then drops the
  /// block unwritten; the next block() reads the file.
  void discard(entry_id e);

  /// Whether the entry's file is older than a superseded block let go (until a whole overwrite is
  /// done: asks the overwrite's events, never waits; a device that failed leaves it behind).
  [[nodiscard]] bool behind(entry_id e);
  [[nodiscard]] const std::filesystem::path& file(entry_id e) const;
  [[nodiscard]] std::size_t capacity() const noexcept;
  /// The bytes the entry's block takes of the cache (its file's, in whole pages).
  [[nodiscard]] std::size_t block_bytes(entry_id e) const;
  [[nodiscard]] host_cache_stats stats() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace taskswap::detail
