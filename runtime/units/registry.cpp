// SPDX-License-Identifier: Apache-2.0
// The unit registry: policies from the rules, registration with the budget checks, home blocks, start.

#include "runtime/runtime_impl.hpp"

#include "device/backend.hpp"

#include "kernels/kernels.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>

namespace taskswap {

using detail::message;

namespace {

unit_policy resolve_policy(const unit_spec& spec, const runtime_options& options, std::vector<bool>& rule_used)
{
  if (spec.policy) { return *spec.policy; }
  unit_policy p = options.defaults;
  for (std::size_t i = 0; i < options.units.size(); ++i) {
    const unit_rule& r = options.units[i];
    if (fnmatch(r.match.c_str(), spec.name.c_str(), 0) != 0) { continue; }
    rule_used[i] = true;
    if (r.residency) { p.residency = *r.residency; }
    if (r.lookahead) { p.lookahead = *r.lookahead; }
    if (r.optimizer) { p.optimizer = *r.optimizer; }
    if (r.lr_scale) { p.lr_scale = *r.lr_scale; }
    if (r.weight_decay) { p.weight_decay = *r.weight_decay; }
    if (r.home) { p.home = *r.home; }
  }
  return p;
}

// What the unit holds, for its disk file's name (Note [Unit files]): a file written by a model
// whose unit differs in any tensor, dtype or size is never read as this one.
std::uint64_t identity_of(const detail::unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  std::string text = detail::message(to_string(l.compute), "/", to_string(l.grad), l.frozen ? "/frozen" : "/trained",
                                     "/", l.home_bytes, ";");
  for (const tensor_info& t : l.tensors) {
    text += detail::message(t.name, "[");
    for (const std::size_t d : t.shape) { text += detail::message(d, ","); }
    text += detail::message("]", t.no_weight_decay ? "n" : "", t.state ? "s" : "", ";");
  }
  return detail::home_identity(text);
}

}  // namespace

unit_policy policy_for(const unit_spec& spec, const runtime_options& options)
{
  std::vector<bool> rule_used(options.units.size(), false);
  return resolve_policy(spec, options, rule_used);
}

unit_footprint footprint(const unit_spec& spec, optimizer_placement placement)
{
  const detail::unit_layout l = detail::make_unit_layout(spec, placement);
  return unit_footprint{.device_bytes = l.device_bytes,
                        .home_bytes = l.home_bytes,
                        .swap_in_bytes = l.travel_bytes,
                        .write_back_bytes = l.writeback_bytes,
                        .grad_bytes = l.device_grad_bytes(),
                        .reduce_bytes = l.reduce_bytes(),
                        .param_bytes = l.params_bytes,
                        .frozen_device_bytes = l.params_bytes,
                        .frozen_swap_in_bytes = l.params_bytes};
}

void runtime::impl::register_units(const runtime_options& options, const std::vector<unit_spec>& specs)
{
  if (specs.empty()) { throw config_error("taskswap runtime: no units given; register at least one unit"); }
  std::vector<bool> rule_used(options.units.size(), false);
  std::vector<detail::modelled_unit> modelled;
  modelled.reserve(specs.size());
  for (const unit_spec& spec : specs) {
    if (spec.name.empty()) { throw config_error("taskswap runtime: a unit has an empty name; name every unit"); }
    const unit_policy policy = resolve_policy(spec, options, rule_used);
    if (!(policy.lr_scale > 0 && std::isfinite(policy.lr_scale))) {
      throw config_error(message("unit '", spec.name, "': lr_scale ", policy.lr_scale, " must be more than 0"));
    }
    if (policy.weight_decay && !(*policy.weight_decay >= 0 && std::isfinite(*policy.weight_decay))) {
      throw config_error(message("unit '", spec.name, "': weight_decay ", *policy.weight_decay, " must be 0 or more"));
    }
    if (policy.lookahead < 0) {
      throw config_error(
        message("unit '", spec.name, "': lookahead ", policy.lookahead, " is negative; use 0 or more"));
    }
    if (spec.activation && policy.home != "host") {
      throw config_error(message("unit '", spec.name, "': an activation block is homed on the host (home = \"",
                                 policy.home, "\" given); give it home = \"host\" or exclude it from that rule"));
    }
    try {
      (void)detail::home_tier_named(policy.home);
    } catch (const config_error& e) {
      throw config_error(message("unit '", spec.name, "': ", e.what()));
    }
    const unit_record& r = units_.add(device_, spec.name, policy, detail::make_unit_layout(spec, policy.optimizer));
    modelled.push_back({.name = r.name,
                        .device_bytes = r.layout.device_bytes,
                        .params_bytes = r.layout.params_bytes,
                        .reduce_bytes = r.layout.reduce_bytes(),  // as the reducer is given them
                        .pinned = r.pinned(),
                        .host_placement = policy.optimizer == optimizer_placement::host,
                        .never_trained = r.layout.frozen,
                        .activation = r.layout.activation,
                        .lookahead = r.policy.residency == residency::prefetch ? r.policy.lookahead : -1});
  }
  for (std::size_t i = 0; i < rule_used.size(); ++i) {
    if (!rule_used[i]) {
      const unit_rule& rule = options.units[i];
      throw config_error(message(rule.origin.empty() ? options.source : rule.origin, ": [[units]] match = \"",
                                 rule.match, "\" matches no registered unit; fix the pattern or remove the rule"));
    }
  }
  residency_.model.emplace(options.device.budget, device_.backend().vm_granularity(),
                           detail::guarded_step::guards(options) ? detail::guarded_step::device_bytes(specs.size()) : 0,
                           std::move(modelled));
  for (unit_record& r : units_) { r.packed = residency_.model->packed(r.index); }
}

void runtime::impl::place_homes()
{
  std::size_t total = 0;
  bool any_host = false;
  std::vector<const detail::home_tier*> used;  // the tiers the units take, each once
  for (unit_record& r : units_) {
    r.home.tier = &detail::home_tier_named(r.policy.home);
    if (std::find(used.begin(), used.end(), r.home.tier) == used.end()) { used.push_back(r.home.tier); }
    total += r.home.tier->pinned_bytes(r.layout.home_bytes);
    any_host = any_host || (r.policy.optimizer == optimizer_placement::host && !r.layout.frozen);
  }
  const std::size_t guard_host =
    detail::guarded_step::guards(options_) ? detail::guarded_step::host_bytes(units_.size()) : 0;
  detail::setup_homes(memory_.homes, device_, total + guard_host, options_.host, options_.storage, used);
  for (unit_record& r : units_) {
    r.home.tier->place(memory_.homes, r.home,
                       {.unit = r.name, .identity = identity_of(r), .bytes = r.layout.home_bytes});
  }
  if (memory_.homes.cache) {
    // The host cache evicts by the plan, as the device does: an entry is a unit's home.
    std::vector<std::uint32_t> unit_of(units_.size());
    for (const unit_record& r : units_) {
      if (r.home.cache != nullptr) { unit_of.at(r.home.entry) = r.index; }
    }
    // The next use that reads the block. A unit being swapped in reads it now: the device's room
    // for it may write other units home first, and their blocks must not take its place (an
    // acquire has consumed its use in the plan, which would call its block never used again). A
    // unit held for training with host placement writes its gradients home at release, and the
    // CPU AdamW then steps the home: its block is in use now, not at its next acquisition. A unit
    // not held whose device copy serves its next use, an update on the device that its write-back
    // brings home whole, reads the block again only if the device lets that copy go, clean, before
    // that use (a prefetch of a unit used sooner may): never. Where the device does, that use
    // reads the home again; on the shapes of docs/storage.md the rule still reads 1.8-3.5 % fewer
    // bytes than ranking such a block just before never, out of a read ahead's reach.
    // A write-back of the unit's device copy replaces its home whole.
    const auto writes_home_whole = [](const unit_record& r) { return r.layout.writeback_bytes >= r.layout.home_bytes; };
    memory_.homes.cache->next_use([this, unit_of, writes_home_whole](detail::host_cache::entry_id e) -> std::uint64_t {
      const unit_record& r = units_[unit_of[e]];
      if (r.incoming || (r.held() && !r.st.frozen_use() && r.policy.optimizer == optimizer_placement::host)) {
        return 0;
      }
      const std::uint64_t next = residency_.plan.next_use(unit_id{r.index});
      const bool device_update = r.policy.optimizer != optimizer_placement::host && writes_home_whole(r);
      if (next == detail::never || (!r.held() && device_update && r.resident_for(true) &&
                                    residency_.plan.use_at(next) != detail::planned_use::frozen)) {
        return detail::host_cache::never;
      }
      return next;
    });
    // A device copy with an update not written home replaces the whole home when it is written
    // back: the block's older bytes need not reach the file first.
    memory_.homes.cache->superseded([this, unit_of, writes_home_whole](detail::host_cache::entry_id e) {
      const unit_record& r = units_[unit_of[e]];
      return r.dirty() && writes_home_whole(r);
    });
  }
  if (any_host) {
    streams_.cpu.emplace(static_cast<int>(memory_.homes.arena->numa_node()), options_.host.optimizer_threads);
  }
  if (guard_host != 0) {
    guard_.emplace(device_, units_.size(), memory_.homes.arena->allocate(guard_host, detail::slab_alignment),
                   static_cast<float>(options_.scaler.enabled ? options_.scaler.init_scale : 1.0));
  }
  // Pinned units are packed together; every other unit has a slot of its own, mapped when resident.
  for (unit_record& r : units_) {
    if (r.pinned()) {
      r.slot = memory_.pool->place_pinned(r.layout.device_bytes);
      go(r, detail::slot_move::place_pinned);
    } else {
      r.pool_slot = memory_.pool->add_slot(r.layout.device_bytes);
    }
  }
}

// Runs before the first plan or acquire, so the trainer can initialise the home copies first.
void runtime::impl::start()
{
  if (life_.started) { return; }
  life_.started = true;
  derive_params();
  for (unit_record& r : units_) {
    if (r.pinned()) { swap_->fill_slot(r); }
  }
  if (guard_) { guard_->upload(units_, streams_.h2d); }
}

// The master is a bf16/f16 unit's source of truth: its params are derived from it before the
// first plan's replica sync (so that rank 0 sends derived ones) and at start. A host home is
// derived at the first call (a pass over memory); after that, and for a disk home always, only a
// home the trainer took home() for since (a zero home, or a checkpoint's, is derived already), so
// that a run of many disk homes does not read and write every unit file at its start, and a plan
// refused after the derivation (replicas that differ) lets the trainer write the masters again.
void runtime::impl::derive_params()
{
  for (unit_record& r : units_) {
    const detail::unit_layout& l = r.layout;
    if (l.compute == dtype::f32 || l.frozen || !(r.home_written || (r.home.cache == nullptr && !life_.derived))) {
      continue;
    }
    std::byte* home = r.home_block();
    detail::host_cast(home + l.params, l.compute, home + l.master, dtype::f32, l.trainable);  // not the state
    r.home_used(nullptr, true);
    r.home_written = false;
  }
  life_.derived = true;
}

}  // namespace taskswap
