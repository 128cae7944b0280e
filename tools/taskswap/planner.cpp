// SPDX-License-Identifier: Apache-2.0
#include "planner.hpp"

#include "planner_replay.hpp"

#include "runtime/residency/residency_model.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace taskswap::tools {
namespace {

void check_rules(const plan_input& in)
{
  for (const unit_rule& rule : in.options.units) {
    const bool used = std::any_of(in.units.begin(), in.units.end(), [&](const unit_spec& u) {
      return !u.policy && fnmatch(rule.match.c_str(), u.name.c_str(), 0) == 0;
    });
    if (!used) {
      throw config_error((rule.origin.empty() ? in.options.source : rule.origin) + ": [[units]] match = \"" +
                         rule.match + "\" matches no unit of the model; fix the pattern or remove the rule");
    }
  }
}

}  // namespace

std::string bytes_text(double bytes)
{
  static constexpr std::array<const char*, 5> units{"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t i = 0;
  while (std::fabs(bytes) >= 1024.0 && i + 1 < units.size()) {
    bytes /= 1024.0;
    ++i;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, i == 0 ? "%.0f %s" : "%.1f %s", bytes, units[i]);
  return buf;
}

double parse_rate(std::string_view text)
{
  std::string t(text);
  const auto slash = t.rfind("/s");
  if (slash == std::string::npos || slash + 2 != t.size()) {
    throw config_error("\"" + t + "\" is not a rate; write e.g. \"25 GB/s\"");
  }
  return static_cast<double>(parse_size(t.substr(0, slash)));
}

std::int64_t largest_batch(std::size_t device_memory, std::size_t reserved, std::size_t fixed, std::size_t per_sample)
{
  if (per_sample == 0 || device_memory <= reserved + fixed) { return 0; }
  return static_cast<std::int64_t>((device_memory - reserved - fixed) / per_sample);
}

namespace {

using replay::never;
using replay::page;
using replay::planned_unit;

// The units as the planner sees them (policies, footprints, uses), and the report's unit figures.
std::vector<planned_unit> plan_units(const plan_input& in, plan_report& r, std::vector<detail::modelled_unit>& modelled)
{
  std::vector<planned_unit> units;
  for (const unit_spec& spec : in.units) {
    planned_unit p;
    p.policy = policy_for(spec, in.options);
    p.cached = home_is_cached(p.policy);
    p.activation = spec.activation;
    if (p.policy.lookahead < 0) {
      throw config_error("unit '" + spec.name + "': lookahead " + std::to_string(p.policy.lookahead) +
                         " is negative; use 0 or more");
    }
    p.fp = footprint(spec, p.policy.optimizer);
    r.all_resident_bytes += (footprint(spec, optimizer_placement::device).device_bytes + 255) / 256 * 256;
    if (p.disk()) {
      ++r.disk_units;
      r.disk_bytes += (p.fp.home_bytes + page - 1) / page * page;
    } else {
      r.pinned_host_bytes += p.fp.home_bytes;
    }
    if (p.pinned()) { ++r.pinned_units; }
    modelled.push_back({.name = spec.name,
                        .device_bytes = p.fp.device_bytes,
                        .params_bytes = p.fp.frozen_device_bytes,
                        .reduce_bytes = p.fp.reduce_bytes,
                        .pinned = p.pinned(),
                        .host_placement = p.host(),
                        .never_trained = !spec.trainable || spec.activation,
                        .activation = spec.activation,
                        .lookahead = p.policy.residency == residency::prefetch ? p.policy.lookahead : -1});
    units.push_back(std::move(p));
  }
  if (!in.frozen.empty() && in.frozen.size() != in.steps.size()) {
    throw config_error("the plan has " + std::to_string(in.steps.size()) + " steps but frozen uses for " +
                       std::to_string(in.frozen.size()) + "; give one list per step, or none");
  }
  if (!in.ordered.empty() && in.ordered.size() != in.steps.size()) {
    throw config_error("the plan has " + std::to_string(in.steps.size()) + " steps but " +
                       std::to_string(in.ordered.size()) + " ordered ones; give one per step, or none");
  }
  for (std::size_t s = 0; s < in.steps.size(); ++s) {
    for (const auto* list : {&replay::frozen_uses(in, s), &in.steps[s]}) {
      for (std::size_t u : *list) {
        if (units.at(u).uses.empty() || units[u].uses.back() != s) { units[u].uses.push_back(s); }
      }
    }
  }
  return units;
}

// Each step as the runtime checks it (its frozen uses first, as the replay acquires them): the
// report's peak, rounding and host-cache figures.
void check_steps(const plan_input& in, const std::vector<planned_unit>& units, const detail::residency_model& model,
                 const std::vector<std::size_t>& file_bytes, bool guarded, plan_report& r)
{
  std::size_t most_held = 0;
  std::size_t most_held_raw = 0;  // the same units' slabs, before rounding
  // With a communicator a unit released whole keeps its room until its bucket's reduction is
  // launched (this rank's units alone known: the runtime's check before the ranks agree), and in
  // a guarded step a trained one keeps it to the step's end (its update waits for end_step).
  const bool communicator = in.options.comm.backend != comm_backend::none;
  for (std::size_t s = 0; s < in.steps.size(); ++s) {
    // The trainer's calls where given; else the step's frozen uses, then its trained ones.
    step_plan step = in.ordered.empty() ? step_plan{} : in.ordered[s];
    if (in.ordered.empty()) {
      for (std::size_t u : replay::frozen_uses(in, s)) {
        step.acquire(unit_id{static_cast<std::uint32_t>(u)}, unit_use::frozen);
      }
      for (std::size_t u : in.steps[s]) { step.acquire(unit_id{static_cast<std::uint32_t>(u)}); }
    }
    const std::vector<std::size_t> points =
      communicator ? model.local_reduction_points(step, in.options.comm.bucket_cap) : std::vector<std::size_t>{};
    const detail::step_peak peak = model.check_step(
      step, s, {.wait_for_reduction = communicator, .trained_count_to_end = guarded, .reduction_points = points});
    if (peak.held > most_held || (peak.held == most_held && peak.raw > most_held_raw)) {
      most_held = peak.held;
      most_held_raw = peak.raw;
    }
    // The disk homes it keeps in the host cache at once, as the runtime's plan check counts them.
    const detail::homes_in_use homes = detail::count_homes_in_use(
      step, [&](std::uint32_t u) { return file_bytes[u]; },
      [&](const step_plan::entry& e) { return units[e.unit.value].host() && e.use == unit_use::train; },
      guarded || communicator);
    r.host_cache_step_bytes = std::max(r.host_cache_step_bytes, homes.bytes);
  }
  r.peak_device_bytes = r.pinned_device_bytes + most_held + model.guard_bytes();
  r.rounding_bytes = r.peak_device_bytes - model.guard_bytes() - model.pinned_packed_bytes() - most_held_raw;
}

// The report's rates: traffic per step, the disk's and the link's time, the largest batches.
void rates(const plan_input& in, const replay::cache_replay& cache, const replay::traffic& t, plan_report& r)
{
  const double n =
    std::max<double>(1.0, static_cast<double>(in.steps.size() - std::min(in.warmup_steps, in.steps.size())));
  r.disk_read_bytes_per_step = cache.read() / n;
  r.disk_write_bytes_per_step = cache.written() / n;
  r.disk_read_bytes_per_second = in.disk_read_bytes_per_second;
  r.disk_write_bytes_per_second = in.disk_write_bytes_per_second;
  r.disk_source = in.disk_source;
  if (in.disk_read_bytes_per_second > 0 && in.disk_write_bytes_per_second > 0) {
    r.disk_ms_per_step = (r.disk_read_bytes_per_step / in.disk_read_bytes_per_second +
                          r.disk_write_bytes_per_step / in.disk_write_bytes_per_second) *
                         1e3;
  }
  r.h2d_bytes_per_step = t.h2d / n;
  r.d2h_bytes_per_step = t.d2h / n;
  r.swap_ins_per_step = t.swap_ins / n;
  r.link_bytes_per_second = in.link_bytes_per_second;
  r.link_source = in.link_source;
  if (in.link_bytes_per_second > 0) {
    r.transfer_ms_per_step = std::max(r.h2d_bytes_per_step, r.d2h_bytes_per_step) / in.link_bytes_per_second * 1e3;
  }
  r.device_memory = in.device_memory;
  r.bytes_per_sample = in.bytes_per_sample;
  r.fixed_bytes = in.fixed_bytes;
  if (in.device_memory > 0 && in.bytes_per_sample > 0) {
    r.max_batch = largest_batch(in.device_memory, r.budget, in.fixed_bytes, in.bytes_per_sample);
    r.max_batch_all_resident =
      largest_batch(in.device_memory, r.all_resident_bytes, in.fixed_bytes, in.bytes_per_sample);
  }
}

}  // namespace

plan_report make_plan(const plan_input& in)
{
  check_rules(in);
  plan_report r;
  r.units = in.units.size();
  r.budget = in.options.device.budget;
  r.steps = in.steps.size();
  r.granule = in.granule;
  // The budget's rules, the registration checks and the plan check are the runtime's own
  // (Note [One residency model]): the planner adds the replay and the figures.
  const bool guarded = in.options.scaler.enabled || in.options.optimizer.clip > 0;
  std::vector<detail::modelled_unit> modelled;
  std::vector<planned_unit> units = plan_units(in, r, modelled);
  const detail::residency_model model(r.budget, in.granule, guarded ? step_guard_device_bytes(in.units.size()) : 0,
                                      std::move(modelled));
  r.pinned_device_bytes = model.pinned_bytes();
  r.all_resident_bytes = model.taken(r.all_resident_bytes);  // all pinned: packed, then whole granules
  if (r.disk_units > 0) {
    r.host_cache_bytes = in.options.storage.host_cache;
    r.pinned_host_bytes += r.host_cache_bytes;
  }
  r.pinned_host_bytes = (r.pinned_host_bytes + page - 1) / page * page;
  std::vector<std::size_t> file_bytes(units.size(), 0);  // 0: not a disk home
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (units[i].disk()) { file_bytes[i] = (units[i].fp.home_bytes + page - 1) / page * page; }
  }
  check_steps(in, units, model, file_bytes, guarded, r);
  // From here on, what each swapped unit's uses take of the budget.
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (units[i].pinned()) { continue; }
    units[i].fp.device_bytes = model.use_charge(static_cast<std::uint32_t>(i), true);
    units[i].fp.frozen_device_bytes = model.use_charge(static_cast<std::uint32_t>(i), false);
  }
  replay::cache_replay cache(in.options.storage.host_cache, file_bytes);
  // The trainer writes the homes' initial values through home() in the units' order before the
  // first step, with nothing planned yet (as the sample does): the cache keeps the last ones,
  // dirty, and their writes come in the steps (the others' are the set-up's, not counted). A
  // resumed run, or a trainer that writes none, starts otherwise: its first steps differ by up
  // to the cache's blocks.
  for (std::size_t i = 0; i < units.size(); ++i) {
    cache.touch(i, replay::cache_replay::access::overwrite, 0.0, [](std::size_t) { return never; });
  }
  const std::size_t room = model.capacity() - model.pinned_bytes();
  const replay::traffic t = in.ordered.empty() ? replay::replay_steps(in, units, model, room, cache)
                                               : replay::replay_ordered(in, units, model, room, cache);
  rates(in, cache, t, r);
  return r;
}

std::size_t disk_homed_units(const plan_input& in)
{
  return static_cast<std::size_t>(std::count_if(in.units.begin(), in.units.end(), [&](const unit_spec& spec) {
    return home_is_cached(policy_for(spec, in.options));
  }));
}

}  // namespace taskswap::tools
