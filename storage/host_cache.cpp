// SPDX-License-Identifier: Apache-2.0
// The host cache in front of the disk home tier: Note [Host cache] in storage/host_cache.hpp.

#include "storage/host_cache.hpp"

#include "device/best_fit_ranges.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <taskswap/error.hpp>

#include <bit>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace taskswap::detail {
namespace {

struct cache_entry {
  std::string unit;
  unit_files::file_index file = 0;
  std::size_t bytes = 0;  // the file's, a multiple of the files' alignment
  std::optional<std::size_t> offset;  // in the cache's memory, while cached (or being read or evicted)
  bool dirty = false;
  bool fresh = true;  // never cached in this run: its home starts as zeros, as a host home does
  bool synced = true;  // false: written to its file since the last flush's sync
  std::optional<unit_files::transfer> io;  // a read filling the block, or a write of it, in flight
  bool io_write = false;
  bool evicting = false;  // its block is freed once its write is done
  bool behind = false;  // its file is older than a superseded block let go: only a whole overwrite brings it back
  bool overwriting = false;  // behind, and its block taken for a whole overwrite not yet queued (used())
  bool catching_up = false;  // behind, with that overwrite queued: caught up once the block's work is done
  bool device_writing = false;  // a stream's work writes the block: its bytes are the caller's once that is done
  std::vector<std::pair<void*, event>> busy;  // per stream, after the work that uses the block
  std::uint64_t last_used = 0;
  std::size_t live_at = 0;  // its index in impl::live, while it has a block
};

}  // namespace

struct host_cache::impl {
  device dev;
  std::span<std::byte> memory;
  unit_files& files;
  best_fit_ranges ranges;
  std::vector<cache_entry> entries;
  // The entries with a block (cached, being read or being written): what pump(), victim() and
  // room() look at, so that their cost follows the cache's size, not the number of units (10,000
  // tasks behind a cache of a few dozen blocks). Unordered: removal swaps the last one in.
  std::vector<entry_id> live;
  std::function<std::uint64_t(entry_id)> next_use = [](entry_id) { return never; };
  std::function<bool(entry_id)> superseded = [](entry_id) { return false; };
  std::uint64_t tick = 0;
  host_cache_stats stats;

  impl(const device& d, std::span<std::byte> m, unit_files& f)
      : dev(d), memory(m), files(f), ranges(m.size(), std::bit_cast<std::uintptr_t>(m.data()))
  {}

  std::size_t alignment() const noexcept { return std::max<std::size_t>(files.alignment(), 4096); }

  std::span<std::byte> span_of(const cache_entry& c) const { return memory.subspan(*c.offset, c.bytes); }

  // Runs `wait` (waits or queries of a block's events); false if it found the device failed
  // (device_error; cuda_error is what an event says after a CUDA sticky error).
  template <class Wait>
  static bool on_live_device(Wait&& wait)
  {
    try {
      std::forward<Wait>(wait)();
      return true;
    } catch (const device_error&) {
      return false;
    } catch (const cuda_error&) {
      return false;
    }
  }
  // Waits for the work that uses the block; it may then be written or reused. A device that
  // failed ends that work (the waits return first, then throw): see abandoned().
  static void quiesce(cache_entry& c)
  {
    if (on_live_device([&] {
          for (auto& [stream, done] : c.busy) { done.synchronize(); }
        })) {
      settled(c);
    } else {
      abandoned(c);
    }
  }
  // Whether the work that uses the block is done (then nothing waits on it). A device that failed
  // answers before its work has drained: not idle (quiesce() waits for it).
  static bool idle(cache_entry& c)
  {
    bool done = true;
    if (!on_live_device([&] {
          for (auto& [stream, ended] : c.busy) {
            if (!ended.query()) {
              done = false;
              return;
            }
          }
        }) ||
        !done) {
      return false;
    }
    settled(c);
    return true;
  }
  // The device failed, and its work on the block is over (the trainer hears of the failure from
  // the runtime, once). A block the device read is as it was. A block it was writing holds what
  // the failure left: it is never written to the file, and its entry is behind (its newest bytes
  // were in the device copy the failure lost); so is an overwrite the entry was catching up with.
  static void abandoned(cache_entry& c)
  {
    c.busy.clear();
    if (c.device_writing) {
      c.behind = true;
      c.dirty = false;
    }
    c.device_writing = false;
    c.catching_up = false;
  }
  // The work that used the block is done: an overwrite queued on it has arrived.
  static void settled(cache_entry& c)
  {
    c.busy.clear();
    c.behind = c.behind && !c.catching_up;
    c.catching_up = false;
    c.device_writing = false;
  }

  // Gives the block back: an eviction, or (`evicted` false) a block whose read failed.
  void free_block(cache_entry& c, bool evicted = true)
  {
    const bool freed = ranges.deallocate(*c.offset, c.bytes);
    TASKSWAP_EXPECTS(freed, message("host cache: the block of '", c.unit, "' was not live"));
    c.offset.reset();
    entries[live.back()].live_at = c.live_at;
    live[c.live_at] = live.back();
    live.pop_back();
    c.behind = c.behind || c.dirty;  // a dirty block freed unwritten: superseded
    c.dirty = false;
    stats.used_bytes -= c.bytes;
    if (evicted) { ++stats.evictions; }
  }

  // Ends the entry's transfer in flight: waiting for it, or (`wait` false) only if it is done.
  // False when it is still in flight. A read's failure frees the block; a write's leaves it dirty.
  bool finish_io(cache_entry& c, bool wait)
  {
    if (!c.io) { return true; }
    if (!wait && !files.done(*c.io)) { return false; }
    const unit_files::transfer t = *c.io;
    c.io.reset();
    const auto started = std::chrono::steady_clock::now();
    try {
      files.wait(t);
    } catch (...) {
      if (c.io_write) {
        c.evicting = false;  // the block stays, dirty: nothing is lost
        c.dirty = true;
      } else {
        free_block(c, false);
      }
      throw;
    }
    if (wait) {
      stats.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }
    if (c.io_write) {
      c.synced = false;
      ++stats.written_back;
      stats.bytes_written += c.bytes;
      if (c.evicting) {
        c.evicting = false;
        free_block(c);
      }
    } else {
      stats.bytes_read += c.bytes;
    }
    return true;
  }

  void start_write(cache_entry& c)
  {
    c.io = files.write(c.file, 0, span_of(c));  // may throw: the block stays dirty
    c.io_write = true;
    c.dirty = false;  // a write into the block after this one's start makes it dirty again
  }

  // The cached entry without a transfer in flight, other than `keep`, whose next use is furthest
  // (then one that needs no write, then the least recently used, then the lowest id); for a
  // prefetch (`ahead`) only one never used again that needs no write and is not let go already.
  cache_entry* victim(entry_id keep, bool ahead)
  {
    cache_entry* best = nullptr;
    cache_candidate best_seen;
    // Backwards: finish_io() may free the block of the entry at k, which moves the last one (seen
    // already) to k.
    for (std::size_t k = live.size(); k-- > 0;) {
      const entry_id i = live[k];
      cache_entry& c = entries[i];
      if (i == keep || (c.io && !finish_io(c, false)) || !c.offset) { continue; }
      // A superseded block is worth nothing (its unit's write-back replaces it whole, unread): it
      // goes first, whenever its unit is used next.
      const cache_candidate seen{.next_use = superseded(i) ? never : next_use(i),
                                 .needs_write = needs_write(c),
                                 .last_used = c.last_used,
                                 .id = i};
      if (ahead && (seen.next_use != never || seen.needs_write || c.evicting)) { continue; }
      if (best == nullptr || evict_before(seen, best_seen)) {
        best = &c;
        best_seen = seen;
      }
    }
    return best;
  }

  // Whether the entry's block must reach its file before it is let go.
  bool needs_write(const cache_entry& c) const
  {
    return c.dirty && !superseded(static_cast<entry_id>(&c - entries.data()));
  }

  // An entry let go (evicting) moves on without waiting: once no stream uses its block, a dirty
  // one's write starts, a clean one's block is freed (a write's end frees it in finish_io).
  void advance(cache_entry& c)
  {
    if (!c.evicting || c.io || !idle(c)) { return; }
    if (needs_write(c)) {
      start_write(c);
    } else {
      c.evicting = false;
      free_block(c);
    }
  }

  [[nodiscard]] std::size_t evicting_bytes() const
  {
    std::size_t bytes = 0;
    for (const entry_id i : live) {
      if (entries[i].evicting) { bytes += entries[i].bytes; }
    }
    return bytes;
  }

  // A block for `e`. On demand it waits for what it evicts. For a prefetch (`ahead`) it lets go of
  // blocks that cost nothing (victim()), one at a time and only while those let go already would
  // not make the room, and waits for nothing: their blocks come free as the streams' work on them
  // ends (pump()); until then, nothing (empty).
  std::optional<std::size_t> room(entry_id e, bool ahead)
  {
    const cache_entry& c = entries[e];
    for (;;) {
      if (std::optional<std::size_t> at = ranges.allocate(c.bytes, alignment())) { return at; }
      if (ahead) {
        if (evicting_bytes() >= c.bytes) { return std::nullopt; }
        cache_entry* v = victim(e, true);
        if (v == nullptr) { return ranges.allocate(c.bytes, alignment()); }  // victim() may have freed blocks
        v->evicting = true;
        advance(*v);
        if (v->offset) { return std::nullopt; }
        continue;
      }
      cache_entry* v = victim(e, false);
      if (v == nullptr) {
        // victim() may have freed blocks whose eviction writes were done.
        if (std::optional<std::size_t> at = ranges.allocate(c.bytes, alignment())) { return at; }
        // Every other block has a transfer in flight: wait for one (a write may free its block, a
        // read's block may then be let go), then look again.
        cache_entry* busy_io = nullptr;
        for (const entry_id i : live) {
          if (i != e && entries[i].io && (busy_io == nullptr || &entries[i] > busy_io)) { busy_io = &entries[i]; }
        }
        if (busy_io == nullptr) {
          throw out_of_memory(message("the host cache (", bytes_text(memory.size()), ") cannot hold the home of '",
                                      c.unit, "' (", bytes_text(c.bytes),
                                      ") beside the homes in use; raise "
                                      "[storage] host_cache"),
                              c.bytes, memory.size() - ranges.used(), memory.size());
        }
        (void)finish_io(*busy_io, true);
        continue;
      }
      quiesce(*v);
      if (!needs_write(*v)) {
        v->evicting = false;
        free_block(*v);
        continue;
      }
      v->evicting = true;
      start_write(*v);
      (void)finish_io(*v, true);
    }
  }

  // Places `e` at `at`: zeros on its first use in this run, nothing when the caller will
  // `overwrite` all of it, else its file's bytes (read started).
  void fill(cache_entry& c, std::size_t at, bool overwrite = false)
  {
    live.push_back(static_cast<entry_id>(&c - entries.data()));  // first: it may throw
    c.live_at = live.size() - 1;
    c.offset = at;
    stats.used_bytes += c.bytes;
    if (overwrite) {
      c.fresh = false;
      return;
    }
    if (c.fresh) {  // a file left by an earlier run is not this run's state (a checkpoint's would be)
      std::memset(span_of(c).data(), 0, c.bytes);
      c.fresh = false;
      c.dirty = true;
      return;
    }
    c.io_write = false;
    try {
      c.io = files.read(c.file, 0, span_of(c));
    } catch (...) {
      free_block(c, false);
      throw;
    }
  }
};

host_cache::host_cache(const device& dev, std::span<std::byte> memory, unit_files& files)
    : impl_(std::make_unique<impl>(dev, memory, files))
{}

host_cache::~host_cache() = default;

host_cache::entry_id host_cache::add(std::string_view unit, std::uint64_t identity, std::size_t bytes)
{
  impl& m = *impl_;
  const unit_files::file_index f = m.files.open(unit, identity, bytes);
  const std::size_t block = m.files.file_bytes(f);
  if (block > m.memory.size()) {
    throw config_error(message("unit '", unit, "' needs ", bytes_text(block), " of host cache for its disk home, but ",
                               "[storage] host_cache is ", bytes_text(m.memory.size()),
                               "; raise host_cache to at least the largest disk-homed unit (better: the units "
                               "of several steps)"));
  }
  cache_entry& c = m.entries.emplace_back();
  c.unit = std::string(unit);
  c.file = f;
  c.bytes = block;
  return static_cast<entry_id>(m.entries.size() - 1);
}

void host_cache::next_use(std::function<std::uint64_t(entry_id)> when) { impl_->next_use = std::move(when); }
void host_cache::superseded(std::function<bool(entry_id)> when) { impl_->superseded = std::move(when); }

std::span<std::byte> host_cache::block(entry_id e, bool overwrite)
{
  impl& m = *impl_;
  TASKSWAP_EXPECTS(e < m.entries.size(), message("host cache entry ", e, " was not added"));
  cache_entry& c = m.entries[e];
  c.last_used = ++m.tick;
  if (c.offset) {
    c.evicting = false;  // wanted again: an eviction's write in flight keeps the block
    if (c.io && !c.io_write && !m.files.done(*c.io)) {
      ++m.stats.misses;  // a prefetch's read not done yet: wait for it
      (void)m.finish_io(c, true);
    } else {
      ++m.stats.hits;  // (a write in flight only reads the block)
      if (c.io && !c.io_write) { (void)m.finish_io(c, false); }
    }
  } else {
    const std::size_t at = *m.room(e, false);
    ++m.stats.misses;
    m.fill(c, at, overwrite);
    (void)m.finish_io(c, true);
  }
  // The caller writes all of it now; until that work is queued (used()) and done (a device
  // failure may drop it) the entry stays behind.
  c.overwriting = c.behind && overwrite;  // (a later block() for anything else forgets it)
  return m.span_of(c);
}

bool host_cache::prefetch(entry_id e)
{
  impl& m = *impl_;
  cache_entry& c = m.entries.at(e);
  if (c.offset) {
    c.evicting = false;  // wanted again: an eviction's write in flight keeps the block
    return true;
  }
  const std::optional<std::size_t> at = m.room(e, true);
  if (!at) { return false; }
  m.fill(c, *at);
  ++m.stats.prefetches;
  return true;
}

bool host_cache::ready(entry_id e)
{
  impl& m = *impl_;
  cache_entry& c = m.entries.at(e);
  if (!c.offset) { return false; }
  if (c.io && c.io_write) {
    c.evicting = false;  // wanted: the block stays
    return true;
  }
  return m.finish_io(c, false);
}

void host_cache::pump()
{
  impl& m = *impl_;
  // Backwards: finishing a transfer or letting a block go frees the block of the entry at k, which
  // moves the last one (seen already) to k.
  for (std::size_t k = m.live.size(); k-- > 0;) {
    cache_entry& c = m.entries[m.live[k]];
    (void)m.finish_io(c, false);
    if (c.offset) { m.advance(c); }
  }
}

void host_cache::used(entry_id e, const stream_view* s, bool wrote)
{
  impl& m = *impl_;
  cache_entry& c = m.entries.at(e);
  TASKSWAP_EXPECTS(c.offset && (!c.io || c.io_write), message("host cache: '", c.unit, "' is used while not cached"));
  c.evicting = false;  // in use: it stays
  c.dirty = c.dirty || wrote;
  c.device_writing = c.device_writing || (wrote && s != nullptr);
  if (wrote && c.overwriting) {  // the overwrite is queued (or, on the host, done)
    c.overwriting = false;
    c.catching_up = true;
  }
  if (s == nullptr) {  // the host did it: done
    if (c.busy.empty()) { m.settled(c); }
    return;
  }
  for (auto& [stream, done] : c.busy) {
    if (stream == s->native_handle()) {
      done.record(*s);
      return;
    }
  }
  c.busy.emplace_back(s->native_handle(), event(m.dev));
  c.busy.back().second.record(*s);
}

void host_cache::flush()
{
  impl& m = *impl_;
  for (cache_entry& c : m.entries) { (void)m.finish_io(c, true); }
  for (cache_entry& c : m.entries) {
    if (c.offset && c.dirty) {
      m.quiesce(c);
      if (!c.dirty) { continue; }  // a device that failed was writing it: not written
      m.start_write(c);
      (void)m.finish_io(c, true);
    }
  }
  for (cache_entry& c : m.entries) {
    if (c.fresh &&
        m.files.existed(c.file)) {  // never used in this run: its home is zeros, not what an earlier run left
      m.files.zero(c.file);
      c.fresh = false;
      c.synced = false;
    }
    if (!c.synced) {
      m.files.sync(c.file);
      c.synced = true;
    } else {
      m.files.check_present(c.file);  // a file deleted under the run is found here, not at the next run
    }
  }
}

void host_cache::discard(entry_id e)
{
  impl& m = *impl_;
  cache_entry& c = m.entries.at(e);
  c.evicting = false;
  try {
    (void)m.finish_io(c, true);
  } catch (const storage_error&) {
    // The bytes of a failed read or write are replaced now anyway (a failed read's block is freed).
  }
  m.quiesce(c);
  if (c.offset) { m.free_block(c, false); }
  c.dirty = false;
  c.behind = false;  // the caller's file is the home now
  c.overwriting = false;
  c.catching_up = false;
  c.fresh = false;
  c.synced = true;  // the caller syncs what it writes
}

bool host_cache::behind(entry_id e)
{
  cache_entry& c = impl_->entries.at(e);
  if (c.behind && c.catching_up) {
    (void)impl_->idle(c);  // the overwrite's work done: caught up (a device that failed: not yet)
  }
  return c.behind;
}

const std::filesystem::path& host_cache::file(entry_id e) const { return impl_->files.path(impl_->entries.at(e).file); }
std::size_t host_cache::capacity() const noexcept { return impl_->memory.size(); }
std::size_t host_cache::block_bytes(entry_id e) const
{
  const std::size_t a = impl_->alignment();  // where the cache places a block
  return (impl_->entries.at(e).bytes + a - 1) / a * a;
}
host_cache_stats host_cache::stats() const noexcept { return impl_->stats; }

}  // namespace taskswap::detail
