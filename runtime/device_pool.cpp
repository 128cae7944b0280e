// SPDX-License-Identifier: Apache-2.0
#include "runtime/device_pool.hpp"

#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <algorithm>
#include <cstdio>

namespace taskswap::detail {

// ---- granule_runs ------------------------------------------------------------------------------

granule_runs::granule_runs(std::size_t granules)
{
  if (granules > 0) { insert(0, granules); }
}

void granule_runs::insert(std::size_t first, std::size_t count)
{
  by_first_.emplace(first, count);
  by_size_.emplace(count, first);
  free_ += count;
}

void granule_runs::erase(std::map<std::size_t, std::size_t>::iterator it)
{
  by_size_.erase({it->second, it->first});
  free_ -= it->second;
  by_first_.erase(it);
}

bool granule_runs::is_free(granule_run r) const
{
  auto it = by_first_.upper_bound(r.first);
  if (it == by_first_.begin()) { return false; }
  --it;
  return r.first + r.count <= it->first + it->second;
}

void granule_runs::take(granule_run r)
{
  auto it = std::prev(by_first_.upper_bound(r.first));
  const std::size_t first = it->first;
  const std::size_t count = it->second;
  erase(it);
  if (r.first > first) { insert(first, r.first - first); }
  if (r.first + r.count < first + count) { insert(r.first + r.count, first + count - r.first - r.count); }
}

void granule_runs::take(std::size_t count, std::vector<granule_run>& into)
{
  if (count == 0) { return; }
  if (const auto fit = by_size_.lower_bound({count, 0}); fit != by_size_.end()) {
    into.push_back({fit->second, count});
    take(into.back());
    return;
  }
  while (count > 0) {
    const auto largest = std::prev(by_size_.end());
    const granule_run r{largest->second, std::min(count, largest->first)};
    take(r);
    into.push_back(r);
    count -= r.count;
  }
}

void granule_runs::give(granule_run r)
{
  std::size_t first = r.first;
  std::size_t count = r.count;
  auto next = by_first_.lower_bound(first);
  if (next != by_first_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      count += prev->second;
      erase(prev);
    }
  }
  next = by_first_.lower_bound(first + count);
  if (next != by_first_.end() && next->first == first + count) {
    count += next->second;
    erase(next);
  }
  insert(first, count);
}

// ---- device_pool -------------------------------------------------------------------------------

namespace {

std::size_t granularity_of(const device& dev, std::size_t budget)
{
  TASKSWAP_EXPECTS(budget > 0, "device pool budget of 0 bytes; set [device] budget");
  const std::size_t g = dev.backend().vm_granularity();
  TASKSWAP_EXPECTS(budget >= g, message("the device budget of ", bytes_text(budget), " is smaller than one granule (",
                                        bytes_text(g), ") of ", dev.name(), "; raise [device] budget"));
  return g;
}

}  // namespace

device_pool::device_pool(const device& dev, std::size_t budget)
    : dev_(dev), budget_(budget), granule_(granularity_of(dev, budget)), granules_(budget / granule_), free_(granules_)
{
  backend& b = dev_.backend();
  try {
    physical_ = b.vm_create(granules_);
  } catch (const out_of_memory& e) {
    throw out_of_memory(message("the device budget of ", bytes_text(budget), " does not fit on ", dev.name(),
                                ", which has ", bytes_text(e.available()), " free of ", bytes_text(e.budget()),
                                "; lower [device] budget (", e.what(), ")"),
                        budget, e.available(), e.budget());
  }
  try {
    pinned_address_ = b.vm_reserve(granules_ * granule_);
  } catch (...) {
    b.vm_release(physical_, granules_);
    throw;
  }
}

device_pool::~device_pool()
{
  if (closed_) { return; }
  for (const std::string& problem : close()) {
    std::fprintf(stderr, "taskswap: device pool teardown: %s\n", problem.c_str());
  }
}

std::vector<std::string> device_pool::close() noexcept
{
  std::vector<std::string> problems;
  if (closed_) { return problems; }
  closed_ = true;
  const auto keep = [&](const error& e) noexcept {
    try {
      problems.emplace_back(e.what());
    } catch (...) {  // out of memory while tearing down: the report is shorter
    }
  };
  backend& b = dev_.backend();
  try {
    b.synchronize();  // nothing may use a range while it is unmapped
  } catch (const error& e) {  // a faulted device: its queued work was abandoned
    keep(e);
  }
  // A range still mapped after a failure is left reserved (and its memory held): freeing either
  // under a live mapping is undefined.
  bool all_unmapped = true;
  const auto report = [&](const error& e) {
    all_unmapped = false;
    keep(e);
  };
  for (slot_state& s : slots_) {
    if (s.address == nullptr) { continue; }  // removed, or packed
    try {
      unmap_all(s);
      b.vm_free(s.address, s.max_granules * granule_);
    } catch (const error& e) {
      report(e);
    }
  }
  for (class_granule& cg : shared_) {
    try {
      if (cg.mapped) { b.vm_unmap(cg.address, 1); }
      b.vm_free(cg.address, granule_);
    } catch (const error& e) {
      report(e);
    }
  }
  try {
    std::size_t at = 0;
    for (const granule_run r : pinned_mapped_) {
      b.vm_unmap(pinned_address_ + at * granule_, r.count);
      at += r.count;
    }
    b.vm_free(pinned_address_, granules_ * granule_);
  } catch (const error& e) {
    report(e);
  }
  if (all_unmapped) { b.vm_release(physical_, granules_); }
  return problems;
}

std::size_t device_pool::free() const
{
  const std::lock_guard lock(mutex_);
  return free_.free() * granule_;
}

void device_pool::note_peak() { peak_ = std::max(peak_, (granules_ - free_.free()) * granule_); }

void device_pool::throw_full(std::size_t bytes, const char* what) const
{
  const std::size_t free = free_.free() * granule_;
  throw out_of_memory(message("device pool on ", dev_.name(), ": ", what, " needs ", bytes_text(taken(bytes)), " (",
                              bytes_text(bytes), " in granules of ", bytes_text(granule_), "); ", bytes_text(free),
                              " of the ", bytes_text(granules_ * granule_), " budget free"),
                      bytes, free, budget_);
}

device_span device_pool::place_pinned(std::size_t bytes)
{
  TASKSWAP_EXPECTS(bytes > 0, "device pool allocation of 0 bytes");
  const std::lock_guard lock(mutex_);
  const std::size_t at = (pinned_bytes_ + 255) / 256 * 256;
  const std::size_t need = (at + bytes + granule_ - 1) / granule_;
  if (need > pinned_granules_) {
    const std::size_t more = need - pinned_granules_;
    if (more > free_.free()) { throw_full(bytes, "a pinned range"); }
    std::vector<granule_run> runs;
    free_.take(more, runs);
    std::size_t mapped = pinned_granules_;
    try {
      for (const granule_run r : runs) {
        dev_.backend().vm_map(pinned_address_ + mapped * granule_, physical_, r.first, r.count);
        pinned_mapped_.push_back(r);
        mapped += r.count;
      }
    } catch (...) {
      // Undo this call: what it mapped is unmapped (as far as that works) and every run it took is free.
      try {
        while (mapped > pinned_granules_) {
          mapped -= pinned_mapped_.back().count;
          dev_.backend().vm_unmap(pinned_address_ + mapped * granule_, pinned_mapped_.back().count);
          pinned_mapped_.pop_back();
        }
      } catch (const error& e) {
        std::fprintf(stderr, "taskswap: device pool: undoing a pinned mapping: %s\n", e.what());
      }
      for (const granule_run r : runs) { free_.give(r); }
      throw;
    }
    pinned_granules_ = need;
  }
  pinned_bytes_ = at + bytes;
  pinned_asked_ += bytes;
  ++pinned_ranges_;
  note_peak();
  return {&dev_.backend(), pinned_address_ + at, bytes};
}

device_pool::slot_id device_pool::add_slot(std::size_t max_bytes)
{
  TASKSWAP_EXPECTS(max_bytes > 0, "device pool slot of 0 bytes");
  if (packs(max_bytes)) {
    const std::lock_guard lock(mutex_);
    slot_state s;
    s.size_class = class_of(max_bytes);
    slots_.push_back(s);
    return static_cast<slot_id>(slots_.size() - 1);
  }
  const std::size_t granules = (max_bytes + granule_ - 1) / granule_;
  std::byte* address = dev_.backend().vm_reserve(granules * granule_);
  const std::lock_guard lock(mutex_);
  slot_state s;
  s.address = address;
  s.max_granules = granules;
  slots_.push_back(s);
  return static_cast<slot_id>(slots_.size() - 1);
}

// The class of a packed slot: the most places of a granule (256-byte aligned) that hold it.
std::uint32_t device_pool::class_of(std::size_t bytes)
{
  const std::size_t per_granule = granule_ / round256(bytes);
  const std::size_t place = granule_ / per_granule / 256 * 256;
  for (std::size_t i = 0; i < classes_.size(); ++i) {
    if (classes_[i].place_bytes == place) { return static_cast<std::uint32_t>(i); }
  }
  classes_.push_back({place, {}});
  return static_cast<std::uint32_t>(classes_.size() - 1);
}

// The fullest class granule with a free place: packing tight leaves other granules to empty.
std::uint32_t device_pool::open_place(const size_class& c) const
{
  const std::size_t places = granule_ / c.place_bytes;
  std::uint32_t best = none;
  for (const std::uint32_t g : c.granules) {
    const class_granule& cg = shared_[g];
    if (cg.taken == 0 || cg.taken == places) { continue; }
    if (best == none || cg.taken > shared_[best].taken) { best = g; }
  }
  return best;
}

device_pool::slot_state& device_pool::live_slot(slot_id slot, const char* call)
{
  TASKSWAP_EXPECTS(slot < slots_.size() && !slots_[slot].removed,
                   message("device pool: ", call, " of slot ", slot, ", which this pool does not have"));
  return slots_[slot];
}

// From the end, so that after a failure the list still names exactly what is mapped.
void device_pool::unmap_all(slot_state& s)
{
  std::size_t end = 0;
  for (const granule_run r : s.mapped) { end += r.count; }
  while (!s.mapped.empty()) {
    const granule_run r = s.mapped.back();
    dev_.backend().vm_unmap(s.address + (end - r.count) * granule_, r.count);
    end -= r.count;
    s.mapped.pop_back();
  }
}

// Frees the slot's own granules from `from_granule` on; they stay mapped there.
void device_pool::give_from(slot_state& s, std::size_t from_granule)
{
  std::size_t at = 0;
  for (const granule_run r : s.mapped) {
    if (at >= s.owned) { break; }
    const std::size_t begin = std::max(at, from_granule);
    const std::size_t end = std::min(at + r.count, s.owned);
    if (begin < end) { free_.give({r.first + (begin - at), end - begin}); }
    at += r.count;
  }
  s.owned = std::min(s.owned, from_granule);
}

device_span device_pool::map_packed(slot_id id, slot_state& s, std::size_t bytes, const quiesce_fn& quiesce)
{
  size_class& c = classes_[s.size_class];
  const std::size_t places = granule_ / c.place_bytes;
  std::uint32_t g = open_place(c);
  if (g == none) {  // an empty class granule, its stale granule still free if one is; else a new one
    for (const std::uint32_t e : c.granules) {
      const class_granule& cg = shared_[e];
      if (cg.taken != 0) { continue; }
      if (g == none || (cg.mapped && free_.is_free({cg.granule, 1}))) { g = e; }
    }
    if (g == none) {
      class_granule cg;
      cg.address = dev_.backend().vm_reserve(granule_);
      cg.places.assign(places, none);
      shared_.push_back(std::move(cg));
      g = static_cast<std::uint32_t>(shared_.size() - 1);
      c.granules.push_back(g);
    }
    class_granule& cg = shared_[g];
    if (cg.mapped && free_.is_free({cg.granule, 1})) {
      free_.take({cg.granule, 1});
    } else {
      if (cg.mapped) {
        if (dev_.backend().vm_maps_memory()) {
          for (const slot_id f : cg.former) { quiesce(f); }
          dev_.backend().vm_unmap(cg.address, 1);
        }
        cg.mapped = false;
      }
      cg.former.clear();
      std::vector<granule_run> run;
      free_.take(1, run);
      try {
        dev_.backend().vm_map(cg.address, physical_, run.front().first, 1);
      } catch (...) {
        free_.give(run.front());
        throw;
      }
      cg.granule = run.front().first;
      cg.mapped = true;
    }
  }
  class_granule& cg = shared_[g];
  const auto place =
    static_cast<std::uint32_t>(std::find(cg.places.begin(), cg.places.end(), none) - cg.places.begin());
  cg.places[place] = id;
  ++cg.taken;
  if (std::find(cg.former.begin(), cg.former.end(), id) == cg.former.end()) { cg.former.push_back(id); }
  s.shared = g;
  s.place = place;
  return mapped(s, bytes, cg.address + place * c.place_bytes);
}

// The slot is live with `bytes` at `at`: the figures follow.
device_span device_pool::mapped(slot_state& s, std::size_t bytes, std::byte* at)
{
  s.bytes = bytes;
  s.live = true;
  slot_bytes_ += bytes;
  ++live_slots_;
  note_peak();
  return {&dev_.backend(), at, bytes};
}

void device_pool::unmap_packed(slot_state& s)
{
  class_granule& cg = shared_[s.shared];
  cg.places[s.place] = none;
  if (--cg.taken == 0) { free_.give({cg.granule, 1}); }  // it stays mapped there
  s.shared = none;
}

device_span device_pool::map_locked(slot_id id, slot_state& s, std::size_t bytes, const quiesce_fn& quiesce)
{
  if (s.size_class != none) { return map_packed(id, s, bytes, quiesce); }
  const std::size_t need = (bytes + granule_ - 1) / granule_;
  // The granules still mapped here, as far as the request reaches: all free, they are taken back
  // with no mapping call; otherwise the slot moves to other granules.
  const auto for_prefix = [&](auto&& visit) {
    std::size_t covered = 0;
    for (const granule_run r : s.mapped) {
      if (covered >= need) { break; }
      const granule_run part{r.first, std::min(r.count, need - covered)};
      if (!visit(part)) { return false; }
      covered += part.count;
    }
    return true;
  };
  if (for_prefix([&](granule_run part) { return free_.is_free(part); })) {
    for_prefix([&](granule_run part) {
      free_.take(part);
      s.owned += part.count;
      return true;
    });
  } else {
    if (dev_.backend().vm_maps_memory()) {
      quiesce(id);
      unmap_all(s);
    } else {
      s.mapped.clear();  // nothing is mapped where each range keeps its own bytes
    }
  }
  if (s.owned < need) {
    // Past the granules mapped here (all of them reused) the addresses are unmapped: map new ones.
    const std::size_t first_new = s.mapped.size();
    free_.take(need - s.owned, s.mapped);
    std::size_t at = s.owned;
    for (std::size_t i = first_new; i < s.mapped.size(); ++i) {
      const granule_run r = s.mapped[i];
      try {
        dev_.backend().vm_map(s.address + at * granule_, physical_, r.first, r.count);
      } catch (...) {
        for (std::size_t j = i; j < s.mapped.size(); ++j) { free_.give(s.mapped[j]); }
        s.mapped.resize(i);
        s.owned = at;
        give_from(s, 0);  // what was taken and mapped stays mapped here, free
        throw;
      }
      at += r.count;
    }
    s.owned = need;
  }
  return mapped(s, bytes, s.address);
}

bool device_pool::fits(slot_id slot, std::size_t bytes) const
{
  const std::lock_guard lock(mutex_);
  TASKSWAP_EXPECTS(slot < slots_.size() && !slots_[slot].removed,
                   message("device pool: fits of slot ", slot, ", which this pool does not have"));
  return has_room(slots_[slot], bytes);
}

// A packed slot needs a free place in its class or a free granule; any other, its granules.
bool device_pool::has_room(const slot_state& s, std::size_t bytes) const
{
  if (s.size_class != none) { return open_place(classes_[s.size_class]) != none || free_.free() >= 1; }
  return (bytes + granule_ - 1) / granule_ <= free_.free();
}

std::optional<device_span> device_pool::try_map(slot_id slot, std::size_t bytes, const quiesce_fn& quiesce)
{
  const std::lock_guard lock(mutex_);
  slot_state& s = live_slot(slot, "map");
  TASKSWAP_EXPECTS(!s.live, message("device pool: slot ", slot, " is mapped already; unmap it first"));
  const std::size_t max = s.size_class != none ? classes_[s.size_class].place_bytes : s.max_granules * granule_;
  TASKSWAP_EXPECTS(bytes > 0 && bytes <= max,
                   message("device pool: cannot map ", bytes, " bytes at slot ", slot, " of ", max, " bytes"));
  if (!has_room(s, bytes)) { return std::nullopt; }
  return map_locked(slot, s, bytes, quiesce);
}

device_span device_pool::map(slot_id slot, std::size_t bytes, const quiesce_fn& quiesce)
{
  if (auto range = try_map(slot, bytes, quiesce)) { return *range; }
  const std::lock_guard lock(mutex_);
  throw_full(bytes, "a range");
}

void device_pool::unmap(slot_id slot)
{
  const std::lock_guard lock(mutex_);
  slot_state& s = live_slot(slot, "unmap");
  TASKSWAP_EXPECTS(s.live, message("device pool: slot ", slot, " is not mapped"));
  if (s.size_class != none) {
    unmap_packed(s);
  } else {
    give_from(s, 0);
  }
  s.live = false;
  slot_bytes_ -= s.bytes;
  --live_slots_;
  s.bytes = 0;
}

device_span device_pool::shrink(slot_id slot, std::size_t bytes)
{
  const std::lock_guard lock(mutex_);
  slot_state& s = live_slot(slot, "shrink");
  TASKSWAP_EXPECTS(s.size_class == none,
                   message("device pool: slot ", slot, " is packed; it cannot keep part of its place"));
  TASKSWAP_EXPECTS(s.live && bytes > 0 && bytes < s.bytes,
                   message("device pool: cannot keep ", bytes, " bytes of slot ", slot,
                           s.live ? message(", which maps ", s.bytes) : std::string(", which is not mapped")));
  give_from(s, (bytes + granule_ - 1) / granule_);
  slot_bytes_ -= s.bytes - bytes;
  s.bytes = bytes;
  return {&dev_.backend(), s.address, bytes};
}

void device_pool::remove_slot(slot_id slot)
{
  const std::lock_guard lock(mutex_);
  slot_state& s = live_slot(slot, "remove");
  if (s.live) {
    if (s.size_class != none) {
      unmap_packed(s);
    } else {
      give_from(s, 0);
    }
    slot_bytes_ -= s.bytes;
    --live_slots_;
  }
  if (s.address != nullptr) {
    unmap_all(s);
    dev_.backend().vm_free(s.address, s.max_granules * granule_);
  }
  s = slot_state{};
  s.removed = true;
}

device_pool_stats device_pool::stats() const
{
  const std::lock_guard lock(mutex_);
  device_pool_stats st;
  st.budget = budget_;
  st.capacity = granules_ * granule_;
  st.granule = granule_;
  st.used = (granules_ - free_.free()) * granule_;
  st.requested = pinned_asked_ + slot_bytes_;
  st.allocations = pinned_ranges_ + live_slots_;
  st.peak = peak_;
  return st;
}

}  // namespace taskswap::detail
