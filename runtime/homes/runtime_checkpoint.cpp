// SPDX-License-Identifier: Apache-2.0
// The runtime's side of checkpoints: its home slabs as sources, save and load, agreed by the ranks.

#include "runtime/runtime_impl.hpp"

#include "device/log.hpp"
#include "storage/crc32c.hpp"

namespace taskswap {

using detail::message;

namespace {

// The home slabs (or, for disk homes, the unit files) a checkpoint copies: every unit's but the
// activation blocks', which are scratch.
std::vector<detail::checkpoint_source> checkpoint_sources(detail::unit_table& units)
{
  std::vector<detail::checkpoint_source> out;
  for (detail::unit_record& r : units) {
    const detail::unit_layout& l = r.layout;
    if (l.activation) { continue; }
    const std::size_t f32_bytes = l.state_bytes;
    detail::checkpoint_source c;
    c.name = r.name;
    c.compute = l.compute;
    for (const tensor_info& t : l.tensors) { c.tensors.emplace_back(t.name, t.shape); }
    c.step = r.step;
    c.trainable = !l.frozen;
    if (r.home.cache != nullptr) {
      c.file = r.home.cache->file(r.home.entry);  // a disk home: its file, current after flush()
    } else {
      c.home = r.home.tier->host_block(r.home);
    }
    c.params = {l.params, l.params_bytes};
    if (l.compute != dtype::f32 && !l.frozen) { c.master = {l.master, f32_bytes}; }
    c.m = {l.m, f32_bytes};
    c.v = {l.v, f32_bytes};
    out.push_back(std::move(c));
  }
  return out;
}

// The manifest of a checkpoint of `sources`: the runtime's step, its optimizer and scaler, `user`.
checkpoint_manifest describe(const runtime::impl& rt, std::span<const detail::checkpoint_source> sources,
                             const std::map<std::string, std::string>& user)
{
  checkpoint_manifest manifest = detail::describe_checkpoint(sources);
  manifest.steps_done = rt.ledger_.step();
  manifest.optimizer = rt.options_.optimizer;
  manifest.user = user;
  if (rt.guard_ && rt.options_.scaler.enabled) {  // current: save_checkpoint flushed, which read it back
    manifest.scaler = checkpoint_scaler{rt.guard_->host_state().scale, rt.guard_->host_state().growth_tracker};
  }
  return manifest;
}

}  // namespace

void runtime::impl::save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user)
{
  if (!reduced_) {
    flush();  // the home copies current; refuses held units
    const std::vector<detail::checkpoint_source> sources = checkpoint_sources(units_);
    detail::write_checkpoint(dir, describe(*this, sources, user), sources);
    return;
  }
  // Every rank holds a replica. Each rank puts a digest of its position and checksums (or -1
  // when it could not get that far) in its own slot; rank 0 writes only when all slots agree,
  // and a second collective tells every rank how that went. No rank throws between the two.
  detail::reducer& red = reduced_->reduction();
  const auto world = static_cast<std::size_t>(red.world());
  const auto rank = static_cast<std::size_t>(red.rank());
  std::string failure;
  checkpoint_manifest manifest;
  std::vector<detail::checkpoint_source> sources;
  std::vector<std::int64_t> digests(world, 0);
  try {
    guarded([&] { flush(); });  // as the public flush: a device failure is kept
    sources = checkpoint_sources(units_);
    manifest = describe(*this, sources, user);
    manifest.world = red.world();
    std::uint32_t digest = detail::crc32c(std::as_bytes(std::span(&manifest.steps_done, 1)));
    for (const checkpoint_unit& u : manifest.units) {
      for (const checkpoint_slab* sl : {&u.params, u.master ? &*u.master : nullptr, &u.m, &u.v}) {
        if (sl != nullptr) { digest = detail::crc32c(std::as_bytes(std::span(&sl->crc32c, 1)), digest); }
      }
    }
    digests[rank] = digest;
  } catch (const std::exception& e) {
    failure = e.what();
    digests[rank] = -1;
  }
  red.sum(digests, message("checkpoint '", dir.string(), "': comparison of the replicas"));
  std::string differ;
  for (std::size_t r = 0; r < world; ++r) {
    if (digests[r] != digests[0] || digests[r] < 0) { differ += (differ.empty() ? "" : ", ") + std::to_string(r); }
  }
  if (failure.empty() && !differ.empty()) {
    failure = message("checkpoint '", dir.string(), "': the replicas of rank(s) ", differ,
                      " are not at the same step with the same checksums as rank 0's (or those ranks failed "
                      "before saving); nothing was written. Save at the same point on every rank");
  }
  if (rank == 0 && differ.empty()) {
    try {
      detail::write_checkpoint(dir, manifest, sources);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  std::vector<std::int64_t> status{differ.empty() && rank == 0 && !failure.empty() ? 1 : 0};
  red.sum(status, message("checkpoint '", dir.string(),
                          "': rank 0's result (rank 0 writes while the others wait: [comm] timeout must exceed the "
                          "time a save takes)"));
  if (!failure.empty()) { throw checkpoint_error(failure); }
  if (status[0] != 0) {
    throw checkpoint_error(message("rank 0 could not write the checkpoint '", dir.string(), "'; its error says why"));
  }
}

checkpoint_manifest runtime::impl::load_checkpoint(const std::filesystem::path& dir)
{
  if (life_.failed && !life_.load_failed) { std::rethrow_exception(life_.failed); }  // after a failed load: load again
  TASKSWAP_EXPECTS(!life_.started,
                   message("load_checkpoint('", dir.string(),
                           "'): call it before the first plan, acquire or flush, as initial values are written"));
  const std::vector<detail::checkpoint_source> sources = checkpoint_sources(units_);
  // With a communicator: every rank loads, or none does; each learns which ranks could not.
  const auto agree = [&](const std::string& failure, std::string_view stage) {
    if (!reduced_) {
      if (!failure.empty()) { throw checkpoint_error(failure); }
      return;
    }
    detail::reducer& red = reduced_->reduction();
    std::vector<std::int64_t> failed(static_cast<std::size_t>(red.world()), 0);
    failed[static_cast<std::size_t>(red.rank())] = failure.empty() ? 0 : 1;
    red.sum(failed, message("checkpoint '", dir.string(), "': the ranks' ", stage));
    if (!failure.empty()) { throw checkpoint_error(failure); }
    std::string ranks;
    for (std::size_t r = 0; r < failed.size(); ++r) {
      if (failed[r] != 0) { ranks += (ranks.empty() ? "" : ", ") + std::to_string(r); }
    }
    if (!ranks.empty()) {
      throw checkpoint_error(message("rank(s) ", ranks, " could not load the checkpoint '", dir.string(), "' (", stage,
                                     "); their errors say why"));
    }
  };
  checkpoint_manifest manifest;
  std::vector<std::size_t> where;
  std::string failure;
  try {
    manifest = read_checkpoint_manifest(dir);
    detail::verify_data(dir, manifest);
    where = detail::match_units(dir, manifest, sources);
    if (manifest.optimizer.clip > 0 && !guard_) {
      throw checkpoint_error(message("checkpoint '", dir.string(),
                                     "' was saved with [optimizer] clip = ", manifest.optimizer.clip,
                                     "; this runtime was made without clipping: set "
                                     "[optimizer] clip (or enable [scaler]) to resume it; nothing was loaded"));
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  agree(failure, "checks; nothing was loaded");
  try {
    for (const unit_record& r : units_) {  // disk homes: their files are written below, not their blocks
      if (r.home.cache != nullptr) { r.home.cache->discard(r.home.entry); }
    }
    detail::read_checkpoint(dir, manifest, sources, where);
  } catch (const std::exception& e) {
    // The home copies are partly overwritten: nothing may train on them.
    failure = message(e.what(), " (load again before training: this runtime refuses every call until then)");
  }
  if (!failure.empty()) {
    life_.failed = std::make_exception_ptr(checkpoint_error(failure));
    life_.load_failed = true;
  }
  agree(failure, "reads");
  life_.failed = nullptr;
  life_.load_failed = false;
  std::size_t source = 0;  // where[] follows the sources: the units but the activation blocks
  for (unit_record& r : units_) {
    if (r.layout.activation) { continue; }
    r.step = manifest.units[where[source++]].step;
    r.home_written = false;  // a checkpoint's params are derived from its master already
  }
  ledger_.restart_at(manifest.steps_done);
  const double configured_clip = options_.optimizer.clip;
  options_.optimizer = manifest.optimizer;
  if (guard_ && manifest.optimizer.clip == 0 && configured_clip > 0) {
    // Saved without clipping (or before taskswap had it): the configuration's clipping stays on.
    options_.optimizer.clip = configured_clip;
    detail::log_once("checkpoint without clip", log_level::info,
                     message("checkpoint '", dir.string(),
                             "' has no [optimizer] clip; keeping this runtime's clip = ", configured_clip));
  }
  if (guard_ && options_.scaler.enabled && manifest.scaler) {  // goes to the device at start
    guard_->host_state().scale = static_cast<float>(manifest.scaler->scale);
    guard_->host_state().growth_tracker = static_cast<std::int32_t>(manifest.scaler->growth_tracker);
  }
  return manifest;
}

}  // namespace taskswap
