// SPDX-License-Identifier: Apache-2.0
// The host cache in front of the disk home tier: Note [Host cache] in storage/host_cache.hpp.

#include "storage/host_cache.hpp"

#include "device/best_fit_ranges.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <taskswap/error.hpp>

#include <bit>
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
  std::optional<std::size_t> offset;  // in the cache's memory, while cached
  bool dirty = false;
  bool fresh = true;  // never cached in this run: its home starts as zeros, as a host home does
  bool synced = true;  // false: written to its file since the last flush's sync
  std::vector<std::pair<void*, event>> busy;  // per stream, after the work that uses the block
  std::uint64_t last_used = 0;
};

}  // namespace

struct host_cache::impl {
  device dev;
  std::span<std::byte> memory;
  unit_files& files;
  best_fit_ranges ranges;
  std::vector<cache_entry> entries;
  std::function<std::uint64_t(entry_id)> next_use = [](entry_id) { return never; };
  std::uint64_t tick = 0;
  host_cache_stats stats;

  impl(const device& d, std::span<std::byte> m, unit_files& f)
      : dev(d), memory(m), files(f), ranges(m.size(), std::bit_cast<std::uintptr_t>(m.data()))
  {}

  std::size_t alignment() const noexcept { return std::max<std::size_t>(files.alignment(), 4096); }

  std::span<std::byte> span_of(const cache_entry& c) const { return memory.subspan(*c.offset, c.bytes); }

  // Waits for the work that uses the block; it may then be written or reused.
  static void quiesce(cache_entry& c)
  {
    for (auto& [stream, done] : c.busy) { done.synchronize(); }
    c.busy.clear();
  }

  void write_back(cache_entry& c)
  {
    quiesce(c);
    files.wait(files.write(c.file, 0, span_of(c)));
    c.dirty = false;
    c.synced = false;
    ++stats.written_back;
    stats.bytes_written += c.bytes;
  }

  void evict(cache_entry& c)
  {
    if (c.dirty) {
      write_back(c);
    } else {
      quiesce(c);
    }
    const bool freed = ranges.deallocate(*c.offset, c.bytes);
    TASKSWAP_EXPECTS(freed, message("host cache: the block of '", c.unit, "' was not live"));
    c.offset.reset();
    stats.used_bytes -= c.bytes;
    ++stats.evictions;
  }

  // The cached entry, other than `keep`, whose next use is furthest (then the least recently used).
  cache_entry* victim(entry_id keep)
  {
    cache_entry* best = nullptr;
    std::uint64_t best_next = 0;
    for (entry_id i = 0; i < entries.size(); ++i) {
      cache_entry& c = entries[i];
      if (i == keep || !c.offset) { continue; }
      const std::uint64_t next = next_use(i);
      if (best == nullptr || next > best_next || (next == best_next && c.last_used < best->last_used)) {
        best = &c;
        best_next = next;
      }
    }
    return best;
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

std::span<std::byte> host_cache::block(entry_id e)
{
  impl& m = *impl_;
  TASKSWAP_EXPECTS(e < m.entries.size(), message("host cache entry ", e, " was not added"));
  cache_entry& c = m.entries[e];
  c.last_used = ++m.tick;
  if (c.offset) {
    ++m.stats.hits;
    return m.span_of(c);
  }
  std::optional<std::size_t> at = m.ranges.allocate(c.bytes, m.alignment());
  while (!at) {
    cache_entry* v = m.victim(e);
    if (v == nullptr) {
      throw out_of_memory(message("the host cache (", bytes_text(m.memory.size()), ") cannot hold the home of '",
                                  c.unit, "' (", bytes_text(c.bytes), "); raise [storage] host_cache"),
                          c.bytes, m.memory.size() - m.ranges.used(), m.memory.size());
    }
    m.evict(*v);
    at = m.ranges.allocate(c.bytes, m.alignment());
  }
  c.offset = *at;
  m.stats.used_bytes += c.bytes;
  if (c.fresh) {  // a file left by an earlier run is not this run's state (a checkpoint's would be)
    std::memset(m.span_of(c).data(), 0, c.bytes);
    c.fresh = false;
    c.dirty = true;
    return m.span_of(c);
  }
  try {
    m.files.wait(m.files.read(c.file, 0, m.span_of(c)));
  } catch (...) {
    (void)m.ranges.deallocate(*c.offset, c.bytes);
    c.offset.reset();
    m.stats.used_bytes -= c.bytes;
    throw;
  }
  ++m.stats.misses;
  m.stats.bytes_read += c.bytes;
  return m.span_of(c);
}

void host_cache::used(entry_id e, const stream_view* s, bool wrote)
{
  impl& m = *impl_;
  cache_entry& c = m.entries.at(e);
  TASKSWAP_EXPECTS(c.offset, message("host cache: '", c.unit, "' is used while not cached"));
  c.dirty = c.dirty || wrote;
  if (s == nullptr) { return; }
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
  for (cache_entry& c : m.entries) {
    if (c.offset && c.dirty) { m.write_back(c); }
  }
  for (cache_entry& c : m.entries) {
    if (!c.synced) {
      m.files.sync(c.file);
      c.synced = true;
    }
  }
}

const std::filesystem::path& host_cache::file(entry_id e) const { return impl_->files.path(impl_->entries.at(e).file); }
std::size_t host_cache::capacity() const noexcept { return impl_->memory.size(); }
host_cache_stats host_cache::stats() const noexcept { return impl_->stats; }

}  // namespace taskswap::detail
