// SPDX-License-Identifier: Apache-2.0
// The device pool's extents (Note [Extents] in device_pool.cpp): the physical handles, who holds
// each, where each is mapped, and the jobs that map, unmap and reshape them on the mapping thread.

#include "runtime/pool/device_pool.hpp"

#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <algorithm>
#include <numeric>

namespace taskswap::detail {

std::uint32_t device_pool::new_extent_id(std::size_t granules)
{
  std::uint32_t e = 0;
  if (!spare_ids_.empty()) {
    e = spare_ids_.back();
    spare_ids_.pop_back();
  } else {
    e = static_cast<std::uint32_t>(extents_.size());
    extents_.emplace_back();
  }
  extents_[e] = extent{.granules = granules, .owner = none, .sites = {}, .former = {}, .live = true};
  ++live_extents_;
  return e;
}

void device_pool::take(std::uint32_t e, std::uint32_t owner)
{
  extent& x = extents_[e];
  free_extents_.erase({x.granules, e});
  free_granules_ -= x.granules;
  x.owner = owner;
}

void device_pool::give(std::uint32_t e)
{
  extent& x = extents_[e];
  x.owner = none;
  x.former.clear();  // their uses came before its owner's, which the next owner's follow
  free_extents_.emplace(x.granules, e);
  free_granules_ += x.granules;
}

// A free extent of exactly `granules`: one that is, or one made from free extents (they are
// unmapped where they are mapped, after their users, and released). The caller takes it.
std::uint32_t device_pool::extent_of(std::size_t granules, job_builder& b, const quiesce_fn& quiesce)
{
  const auto fit = free_extents_.lower_bound({granules, 0});
  if (fit != free_extents_.end() && fit->first == granules) { return fit->second; }
  std::vector<std::uint32_t> from;  // the smallest larger one, else the largest ones first
  std::size_t sum = 0;
  if (fit != free_extents_.end()) {
    from.push_back(fit->second);
    sum = fit->first;
  } else {
    for (auto it = free_extents_.rbegin(); sum < granules; ++it) {
      from.push_back(it->second);
      sum += it->first;
    }
  }
  using kind = slot_mapper::call::kind;
  for (const std::uint32_t e : from) {
    detach(e, b, quiesce);
    free_extents_.erase({extents_[e].granules, e});
    b.job.calls.push_back({.what = kind::release, .extent = e, .granules = extents_[e].granules});
    extents_[e].live = false;
    spare_ids_.push_back(e);
    --live_extents_;
  }
  const auto make = [&](std::size_t n) {
    const std::uint32_t e = new_extent_id(n);
    b.job.calls.push_back({.what = kind::create, .extent = e, .granules = n});
    free_extents_.emplace(n, e);
    return e;
  };
  const std::uint32_t made = make(granules);
  if (sum > granules) { static_cast<void>(make(sum - granules)); }
  ++reshapes_;
  return made;
}

// The fence waits for the earlier users of `site` (once a job).
void device_pool::quiesce_site(std::uint32_t site, job_builder& b, const quiesce_fn& quiesce)
{
  if (std::find(b.quiesced.begin(), b.quiesced.end(), site) != b.quiesced.end()) { return; }
  b.quiesced.push_back(site);
  if (!dev_.backend().vm_maps_memory()) { return; }  // each range keeps its own bytes: nothing moves under a user
  const auto ask = [&](slot_id slot) {
    std::string users;
    if (quiesce) {
      users = quiesce(slot, fences(b));
    } else {
      dev_.synchronize();  // no caller to ask: wait for everything
    }
    if (!users.empty()) { b.job.fence_users += (b.job.fence_users.empty() ? "" : ", ") + users; }
  };
  if ((site & class_site) != 0) {
    for (const slot_id f : shared_[site & ~class_site].former) { ask(f); }
  } else {
    ask(site);
  }
}

// Unmaps the extents mapped at `site` from its index-th on (the site owns none of them).
void device_pool::unmap_site_from(std::uint32_t site, std::size_t index, job_builder& b, const quiesce_fn& quiesce)
{
  quiesce_site(site, b, quiesce);
  const auto forget = [&](std::uint32_t e) {
    std::vector<std::uint32_t>& at = extents_[e].sites;
    at.erase(std::find(at.begin(), at.end(), site));
  };
  if ((site & class_site) != 0) {
    class_granule& cg = shared_[site & ~class_site];
    b.job.calls.push_back({.what = slot_mapper::call::kind::unmap, .address = cg.address, .granules = 1});
    forget(cg.extent);
    cg.extent = none;
    cg.former.clear();
    return;
  }
  slot_state& s = slots_[site];
  std::size_t offset = 0;
  std::size_t count = 0;
  for (std::size_t i = 0; i < s.mapped.size(); ++i) {
    (i < index ? offset : count) += extents_[s.mapped[i]].granules;
    if (i >= index) { forget(s.mapped[i]); }
  }
  b.job.calls.push_back(
    {.what = slot_mapper::call::kind::unmap, .address = s.address + offset * granule_, .granules = count});
  s.mapped.resize(index);
}

// Unmaps the extent mapped `index`-th at slot `id` (another slot's now), `at` granules in, alone:
// a new one takes its place.
void device_pool::replace_mapped(slot_id id, std::size_t index, std::size_t at, job_builder& b,
                                 const quiesce_fn& quiesce)
{
  quiesce_site(id, b, quiesce);
  slot_state& s = slots_[id];
  std::vector<std::uint32_t>& sites = extents_[s.mapped[index]].sites;
  sites.erase(std::find(sites.begin(), sites.end(), id));
  b.job.calls.push_back({.what = slot_mapper::call::kind::unmap,
                         .address = s.address + at * granule_,
                         .granules = extents_[s.mapped[index]].granules});
  s.mapped[index] = none;  // until the caller maps the new one
}

// Unmaps the free extent `e` wherever it is mapped.
void device_pool::detach(std::uint32_t e, job_builder& b, const quiesce_fn& quiesce)
{
  const std::vector<std::uint32_t> sites = extents_[e].sites;
  for (const std::uint32_t site : sites) {
    if ((site & class_site) != 0) {
      unmap_site_from(site, 0, b, quiesce);
    } else {
      const std::vector<std::uint32_t>& m = slots_[site].mapped;
      unmap_site_from(site, static_cast<std::size_t>(std::find(m.begin(), m.end(), e) - m.begin()), b, quiesce);
    }
  }
}

void device_pool::map_at(std::byte* address, std::uint32_t e, std::uint32_t site, job_builder& b)
{
  b.job.calls.push_back(
    {.what = slot_mapper::call::kind::map, .extent = e, .address = address, .granules = extents_[e].granules});
  if (site != pinned_owner) { extents_[e].sites.push_back(site); }
}

// The extent `e`, just taken by the slot `owner`, stays mapped at the slots that had it before,
// where it is of no use until it is free again; each of those mappings is unmapped in `tidy`,
// with the extents mapped after it there (a slot's mappings stay one run). Each extent unmapped
// keeps the slot and where it was there among its `former`.
void device_pool::unmap_stale(std::uint32_t e, std::uint32_t owner, job_builder& tidy, const quiesce_fn& quiesce)
{
  const std::vector<std::uint32_t> sites = extents_[e].sites;
  for (const std::uint32_t site : sites) {
    if (site == owner || (site & class_site) != 0) { continue; }  // a class granule's stays: it is one
    const std::vector<std::uint32_t>& m = slots_[site].mapped;
    const auto index = static_cast<std::size_t>(std::find(m.begin(), m.end(), e) - m.begin());
    std::size_t at = 0;
    for (std::size_t i = 0; i < m.size(); ++i) {
      if (i >= index) { extents_[m[i]].former.emplace_back(site, at); }
      at += extents_[m[i]].granules;
    }
    unmap_site_from(site, index, tidy, quiesce);
  }
}

void device_pool::fence(job_builder& b)
{
  if (!b.job.fence_users.empty()) {
    b.job.fence.emplace(dev_);
    b.job.fence->record(fences(b));
  }
}

device_pool::ticket device_pool::submit(job_builder& b)
{
  if (b.job.calls.empty()) { return 0; }
  fence(b);
  ++jobs_;
  return mapper_.submit(std::move(b.job));
}

void device_pool::defer(job_builder& b)
{
  if (b.job.calls.empty()) { return; }
  fence(b);
  ++deferred_;
  mapper_.defer(std::move(b.job));
}

}  // namespace taskswap::detail
