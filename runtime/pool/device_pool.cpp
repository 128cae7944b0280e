// SPDX-License-Identifier: Apache-2.0
#include "runtime/pool/device_pool.hpp"

#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace taskswap::detail {

// Note [Extents]
// ~~~~~~~~~~~~~~
// The driver's virtual-memory calls cost their caller by the handle, not by the byte. On an H200
// (bench/vmm_probe.cu, docs/gpu-results.md) mapping a handle and granting access to it costs
// about 35 us and unmapping it 20 us, whether it is one granule (2 MiB) or 96 (192 MiB): a slot of
// 192 MiB mapped as 96 handles of one granule took 3.4 ms, as one handle 55 us, and with a copy or
// a kernel in flight each figure about doubles. The driver maps a handle only whole (cuMemMap
// refuses an offset into one), so the physical memory is kept as extents, each one handle, sized
// to the slots that map them:
// - A slot maps one extent of its size, or two where a later shrink() keeps a prefix (a unit held
//   frozen gives up all but its parameters, so its whole mapping parts after them).
// - A slot whose extents were taken maps free extents of the sizes it needs; where there is none
//   of a size, free extents are released and one of that size made from their granules (a
//   reshape, with what is left over made an extent of its own). Units of one shape swap through
//   the same extents with no reshape; any request of at most the free granules is still met.
// - At construction the budget is taken as extents of up to 64 MiB: each reshape then releases
//   few handles, and the device holds the budget from the start.
// - A reshape gives memory back to the driver for the moment between the release and the create.
//   Another allocator on the device taking it in that moment fails the map with out_of_memory.
//
// Note [Deferred unmaps]
// ~~~~~~~~~~~~~~~~~~~~~~
// A slot leaves its free extents mapped where they are, so it takes them back with no call while
// no other slot has taken them. Once one has, the old mapping only costs: the slot's next map must
// unmap it first, in the job its swap-in waits for, and a reshape must unmap it before it releases
// the extent. So when a slot maps (map_slot) an extent that other slots still map, their mappings
// of it, and of the extents after it there (a slot's mappings stay one run), are unmapped in a
// deferred job (slot_mapper). Its fence is on a stream the deferred jobs share, recorded after the
// swap-in's own job is queued: that job never waits for those slots' users (the victim's
// write-back, Note [Handoff]), though a job that needs a deferred one waits for every user queued
// on that stream before it. The mapping thread runs a deferred job as soon as its fence has
// completed, ahead of queued maps, or else just before a job that needs its addresses or releases
// a handle it unmaps: the unmaps leave the jobs the trainer waits for and spread over the step. (A
// streamed trunk's backward leaves each layer's extents mapped at the layer it trained; unmapped
// lazily, they would all fall due at the next forward's start.) A packed slot's or the pinned
// region's map leaves old mappings as they are. The pool's record forgets the unmapped ones at
// once, but each extent keeps where it was mapped (`former`, until it is next given back): those
// slots' users are still earlier users of its memory (sharers, shares_aligned).
//
// Note [Mapping off the trainer's thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every decision (which extent goes where, what is released, the free counts) is made here, on the
// caller's thread, at once, so the budget stays exact and the caller's view never lags. The driver
// calls that carry a decision out are queued to the mapping thread (slot_mapper) as one job, in
// decision order (and the unmaps of other slots' old mappings as a deferred job); map() returns the range with the job's ticket, and whoever queues work on the
// range waits until ready(ticket) (the swap engine enqueues a swap-in's copy then). What moves
// waits for its earlier users there too: the quiesce callback makes a fence stream wait for their
// events still in flight, the job records its own fence event after them, and the thread waits for
// it before its calls. Events recorded later by the caller do not reach the fence. A granule mapped
// at a second address while its owner's write-back still reads it at the first is what lets a
// swap-in take a victim's extents without waiting for that copy.

namespace {

constexpr std::size_t extent_chunk_bytes = std::size_t{64} << 20;  // the extents taken at construction

std::size_t granularity_of(const device& dev, std::size_t budget)
{
  TASKSWAP_EXPECTS(budget > 0, "device pool budget of 0 bytes; set [device] budget");
  const std::size_t g = dev.backend().vm_granularity();
  TASKSWAP_EXPECTS(budget >= g, message("the device budget of ", bytes_text(budget), " is smaller than one granule (",
                                        bytes_text(g), ") of ", dev.name(), "; raise [device] budget"));
  return g;
}

}  // namespace

device_pool::device_pool(const device& dev, std::size_t budget, std::chrono::milliseconds timeout)
    : dev_(dev),
      budget_(budget),
      granule_(granularity_of(dev, budget)),
      granules_(budget / granule_),
      fences_(dev),
      deferred_fences_(dev),
      mapper_(dev, timeout)
{
  backend& b = dev_.backend();
  const std::size_t chunk = std::max<std::size_t>(1, extent_chunk_bytes / granule_);
  slot_mapper::job made;
  for (std::size_t at = 0; at < granules_; at += chunk) {
    const std::uint32_t e = new_extent_id(std::min(chunk, granules_ - at));
    made.calls.push_back({.what = slot_mapper::call::kind::create, .extent = e, .granules = extents_[e].granules});
    free_extents_.emplace(extents_[e].granules, e);
  }
  free_granules_ = granules_;
  try {
    mapper_.run_here(made);
    pinned_address_ = b.vm_reserve(granules_ * granule_);
  } catch (...) {
    static_cast<void>(mapper_.stop());
    for (const std::string& problem : mapper_.release_all()) {
      std::fprintf(stderr, "taskswap: device pool: %s\n", problem.c_str());
    }
    try {
      throw;
    } catch (const out_of_memory& e) {
      throw out_of_memory(message("the device budget of ", bytes_text(budget), " does not fit on ", dev.name(),
                                  ", which has ", bytes_text(e.available()), " free of ", bytes_text(e.budget()),
                                  "; lower [device] budget (", e.what(), ")"),
                          budget, e.available(), e.budget());
    }
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
  const auto keep = [&](const std::exception& e) noexcept {
    try {
      problems.emplace_back(e.what());
    } catch (...) {  // out of memory while tearing down: the report is shorter
    }
  };
  backend& b = dev_.backend();
  if (const std::exception_ptr failed = mapper_.stop()) {
    try {
      std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      keep(e);
    } catch (...) {}
  }
  try {
    b.synchronize();  // nothing may use a range while it is unmapped
  } catch (const error& e) {  // a faulted device: its queued work was abandoned
    keep(e);
  }
  // What the mapping thread's calls did is what is undone, whatever the pool's record says after a
  // failed call. Where a mapping cannot be undone, the addresses stay reserved.
  const std::vector<std::string> undone = mapper_.release_all();
  problems.insert(problems.end(), undone.begin(), undone.end());
  if (!undone.empty()) { return problems; }
  for (const slot_state& s : slots_) {
    if (s.address != nullptr) { b.vm_free(s.address, s.max_granules * granule_); }
  }
  for (const class_granule& cg : shared_) { b.vm_free(cg.address, granule_); }
  b.vm_free(pinned_address_, granules_ * granule_);
  return problems;
}

void device_pool::note_peak() { peak_ = std::max(peak_, (granules_ - free_granules_) * granule_); }

void device_pool::throw_full(std::size_t bytes, const char* what) const
{
  throw out_of_memory(message("device pool on ", dev_.name(), ": ", what, " needs ", bytes_text(taken(bytes)), " (",
                              bytes_text(bytes), " in granules of ", bytes_text(granule_), "); ", bytes_text(free()),
                              " of the ", bytes_text(granules_ * granule_), " budget free"),
                      bytes, free(), budget_);
}

// ---- ranges ------------------------------------------------------------------------------------

device_span device_pool::place_pinned(std::size_t bytes)
{
  TASKSWAP_EXPECTS(bytes > 0, "device pool allocation of 0 bytes");
  const std::size_t at = (pinned_bytes_ + 255) / 256 * 256;
  const std::size_t need = (at + bytes + granule_ - 1) / granule_;
  if (need > pinned_granules_) {
    const std::size_t more = need - pinned_granules_;
    if (more > free_granules_) { throw_full(bytes, "a pinned range"); }
    job_builder b;
    const std::uint32_t e = extent_of(more, b, nullptr);
    take(e, pinned_owner);
    map_at(pinned_address_ + pinned_granules_ * granule_, e, pinned_owner, b);
    pinned_extents_.push_back(e);
    pinned_granules_ = need;
    wait(submit(b));  // registration: the range is used at once
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
  slot_state s;
  if (packs(max_bytes)) {
    s.size_class = class_of(max_bytes);
  } else {
    s.max_granules = (max_bytes + granule_ - 1) / granule_;
    s.address = dev_.backend().vm_reserve(s.max_granules * granule_);
  }
  slots_.push_back(std::move(s));
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

device_pool::mapping device_pool::map_packed(slot_id id, slot_state& s, std::size_t bytes, const quiesce_fn& quiesce)
{
  size_class& c = classes_[s.size_class];
  const std::size_t places = granule_ / c.place_bytes;
  std::uint32_t g = open_place(c);
  if (g == none) {  // an empty class granule, its extent still free if one's is; else a new one
    const auto own_free = [&](const class_granule& cg) {
      return cg.extent != none && extents_[cg.extent].owner == none;
    };
    for (const std::uint32_t e : c.granules) {
      const class_granule& cg = shared_[e];
      if (cg.taken != 0) { continue; }
      if (g == none || own_free(cg)) { g = e; }
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
    const std::uint32_t site = class_site | g;
    if (own_free(cg)) {
      take(cg.extent, site);
    } else {
      job_builder b;
      if (cg.extent != none) { unmap_site_from(site, 0, b, quiesce); }
      const std::uint32_t e = extent_of(1, b, quiesce);
      take(e, site);
      map_at(cg.address, e, site, b);
      shared_[g].extent = e;
      shared_[g].ready = submit(b);
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
  return {mapped(s, bytes, cg.address + place * c.place_bytes), cg.ready};
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
  if (--cg.taken == 0) { give(cg.extent); }  // it stays mapped there
  s.shared = none;
}

// The extents still mapped at the slot cover `need` granules exactly, all free, parting at
// `split` (0: anywhere): the slot takes them back with no call.
bool device_pool::reuses_mapped(slot_state& s, std::size_t need, std::size_t split)
{
  std::size_t sum = 0;
  std::size_t n = 0;
  bool parts = split == 0;
  for (; n < s.mapped.size() && sum < need; ++n) {
    const extent& x = extents_[s.mapped[n]];
    if (x.owner != none) { return false; }
    sum += x.granules;
    parts = parts || sum == split;
  }
  if (sum != need || !parts) { return false; }
  for (std::size_t i = 0; i < n; ++i) { take(s.mapped[i], static_cast<std::uint32_t>(&s - slots_.data())); }
  s.owned = n;
  return true;
}

device_pool::mapping device_pool::map_slot(slot_id id, slot_state& s, std::size_t bytes, std::size_t keep,
                                           const quiesce_fn& quiesce)
{
  const std::size_t need = (bytes + granule_ - 1) / granule_;
  std::size_t split = keep > 0 && keep < bytes ? (keep + granule_ - 1) / granule_ : 0;
  if (split >= need) { split = 0; }
  if (reuses_mapped(s, need, split)) { return {mapped(s, bytes, s.address), s.ready}; }
  const std::vector<std::size_t> pieces = split != 0 ? std::vector{split, need - split} : std::vector{need};
  // Where the extents mapped here part as the pieces do, each stays if it is free and is replaced
  // alone if another slot took it; from the first that does not fit the pieces on, they move, and
  // so do those past the pieces (an extent mapped here twice would be taken twice).
  job_builder b;
  std::size_t same = 0;
  while (same < pieces.size() && same < s.mapped.size() && extents_[s.mapped[same]].granules == pieces[same]) {
    ++same;
  }
  if (same < s.mapped.size()) { unmap_site_from(id, same, b, quiesce); }
  // The ones that stay are taken first: a reshape below must not release them.
  std::vector<bool> stays(pieces.size(), false);
  for (std::size_t i = 0; i < same; ++i) {
    if (extents_[s.mapped[i]].owner == none) {
      take(s.mapped[i], id);
      stays[i] = true;
    }
  }
  std::size_t at = 0;
  std::vector<std::uint32_t> taken;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (!stays[i]) {
      // The extent first: a reshape may unmap extents mapped here past the pieces.
      const std::uint32_t e = extent_of(pieces[i], b, quiesce);
      if (i < same) { replace_mapped(id, i, at, b, quiesce); }
      take(e, id);
      taken.push_back(e);
      map_at(s.address + at * granule_, e, id, b);
      if (i < same) {
        s.mapped[i] = e;
      } else {
        s.mapped.push_back(e);
      }
    }
    at += pieces[i];
  }
  s.owned = pieces.size();
  if (const ticket t = submit(b); t != 0) { s.ready = t; }
  // After the submit: the swap-in's job must not wait for the users of the mappings left elsewhere
  // (a victim's write-back still reads its extents there; Note [Handoff]).
  job_builder tidy;
  tidy.deferred = true;
  for (const std::uint32_t e : taken) { unmap_stale(e, id, tidy, quiesce); }
  defer(tidy);
  return {mapped(s, bytes, s.address), s.ready};
}

bool device_pool::shares_aligned(slot_id a, slot_id b) const
{
  if (a == b || a >= slots_.size() || b >= slots_.size()) { return false; }
  const slot_state& x = slots_[a];
  const slot_state& y = slots_[b];
  if (x.size_class != none || y.size_class != none || !x.live) { return false; }
  const auto offset_in = [&](const slot_state& s, std::uint32_t e) {  // in granules; none: not mapped there
    std::size_t at = 0;
    for (const std::uint32_t m : s.mapped) {
      if (m == e) { return at; }
      at += extents_[m].granules;
    }
    return std::size_t{none};
  };
  bool shared = false;
  for (const std::uint32_t e : x.mapped) {
    const extent& m = extents_[e];
    std::size_t in_b = none;  // where b maps it, or mapped it before x took it
    if (std::find(m.sites.begin(), m.sites.end(), b) != m.sites.end()) {
      in_b = offset_in(y, e);
    } else {
      const auto f = std::find_if(m.former.begin(), m.former.end(), [&](const auto& p) { return p.first == b; });
      if (f == m.former.end()) { continue; }
      in_b = f->second;
    }
    if (offset_in(x, e) != in_b) { return false; }
    shared = true;
  }
  return shared;
}

bool device_pool::sharers(slot_id s, std::vector<slot_id>& out) const
{
  out.clear();
  if (s >= slots_.size() || slots_[s].size_class != none) { return false; }
  const auto add = [&](std::uint32_t site) {
    if (site != s && std::find(out.begin(), out.end(), site) == out.end()) { out.push_back(site); }
  };
  for (const std::uint32_t e : slots_[s].mapped) {
    for (const std::uint32_t site : extents_[e].sites) {
      if ((site & class_site) != 0) { return false; }
      add(site);
    }
    for (const auto& [site, at] : extents_[e].former) { add(site); }
  }
  return true;
}

bool device_pool::fits(slot_id slot, std::size_t bytes) const
{
  TASKSWAP_EXPECTS(slot < slots_.size() && !slots_[slot].removed,
                   message("device pool: fits of slot ", slot, ", which this pool does not have"));
  return has_room(slots_[slot], bytes);
}

// A packed slot needs a free place in its class or a free granule; any other, its granules.
bool device_pool::has_room(const slot_state& s, std::size_t bytes) const
{
  if (s.size_class != none) { return open_place(classes_[s.size_class]) != none || free_granules_ >= 1; }
  return (bytes + granule_ - 1) / granule_ <= free_granules_;
}

std::optional<device_pool::mapping> device_pool::try_map(slot_id slot, std::size_t bytes, std::size_t keep,
                                                         const quiesce_fn& quiesce)
{
  slot_state& s = live_slot(slot, "map");
  TASKSWAP_EXPECTS(!s.live, message("device pool: slot ", slot, " is mapped already; unmap it first"));
  const std::size_t max = s.size_class != none ? classes_[s.size_class].place_bytes : s.max_granules * granule_;
  TASKSWAP_EXPECTS(bytes > 0 && bytes <= max,
                   message("device pool: cannot map ", bytes, " bytes at slot ", slot, " of ", max, " bytes"));
  if (!has_room(s, bytes)) { return std::nullopt; }
  if (s.size_class != none) { return map_packed(slot, s, bytes, quiesce); }
  return map_slot(slot, s, bytes, keep, quiesce);
}

device_pool::mapping device_pool::map(slot_id slot, std::size_t bytes, std::size_t keep, const quiesce_fn& quiesce)
{
  if (auto m = try_map(slot, bytes, keep, quiesce)) { return *m; }
  throw_full(bytes, "a range");
}

void device_pool::unmap(slot_id slot)
{
  slot_state& s = live_slot(slot, "unmap");
  TASKSWAP_EXPECTS(s.live, message("device pool: slot ", slot, " is not mapped"));
  if (s.size_class != none) {
    unmap_packed(s);
  } else {
    for (std::size_t i = 0; i < s.owned; ++i) { give(s.mapped[i]); }
    s.owned = 0;
  }
  s.live = false;
  slot_bytes_ -= s.bytes;
  --live_slots_;
  s.bytes = 0;
}

device_span device_pool::shrink(slot_id slot, std::size_t bytes)
{
  slot_state& s = live_slot(slot, "shrink");
  TASKSWAP_EXPECTS(s.size_class == none,
                   message("device pool: slot ", slot, " is packed; it cannot keep part of its place"));
  TASKSWAP_EXPECTS(s.live && bytes > 0 && bytes < s.bytes,
                   message("device pool: cannot keep ", bytes, " bytes of slot ", slot,
                           s.live ? message(", which maps ", s.bytes) : std::string(", which is not mapped")));
  const std::size_t keep = (bytes + granule_ - 1) / granule_;
  std::size_t sum = 0;
  std::size_t n = 0;
  while (n < s.owned && sum < keep) { sum += extents_[s.mapped[n++]].granules; }
  TASKSWAP_EXPECTS(sum == keep, message("device pool: slot ", slot, " cannot keep ", bytes,
                                        " bytes: its extents do not part there (map it with that keep)"));
  for (std::size_t i = n; i < s.owned; ++i) { give(s.mapped[i]); }
  s.owned = n;
  slot_bytes_ -= s.bytes - bytes;
  s.bytes = bytes;
  return {&dev_.backend(), s.address, bytes};
}

void device_pool::remove_slot(slot_id slot)
{
  slot_state& s = live_slot(slot, "remove");
  if (s.live) {
    if (s.size_class != none) {
      unmap_packed(s);
    } else {
      for (std::size_t i = 0; i < s.owned; ++i) { give(s.mapped[i]); }
    }
    slot_bytes_ -= s.bytes;
    --live_slots_;
  }
  if (s.address != nullptr) {
    job_builder b;
    if (!s.mapped.empty()) {
      s.owned = 0;
      b.quiesced.push_back(slot);  // no work uses it any more
      unmap_site_from(slot, 0, b, nullptr);
    }
    b.job.calls.push_back(
      {.what = slot_mapper::call::kind::free_addresses, .address = s.address, .granules = s.max_granules * granule_});
    static_cast<void>(submit(b));
  }
  s = slot_state{};
  s.removed = true;
}

device_pool_stats device_pool::stats() const
{
  device_pool_stats st;
  st.budget = budget_;
  st.capacity = granules_ * granule_;
  st.granule = granule_;
  st.used = (granules_ - free_granules_) * granule_;
  st.requested = pinned_asked_ + slot_bytes_;
  st.allocations = pinned_ranges_ + live_slots_;
  st.peak = peak_;
  st.extents = live_extents_;
  st.reshapes = reshapes_;
  st.mapping_jobs = jobs_;
  st.deferred_jobs = deferred_;
  return st;
}

}  // namespace taskswap::detail
