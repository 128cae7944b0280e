// SPDX-License-Identifier: Apache-2.0
#pragma once

// runtime::impl: the runtime's coordinator. It holds the parts below, each owning its state, and
// carries out the public calls across them; docs/runtime.md#files says which file does what, and
// runtime_parts.hpp how the streams depend on each other (Note [Streams]).

#include <taskswap/runtime.hpp>

#include "runtime/runtime_life.hpp"
#include "runtime/runtime_parts.hpp"
#include "runtime/step/guarded_step.hpp"
#include "runtime/step/reduced_step.hpp"
#include "runtime/step/unit_update.hpp"
#include "runtime/swap/step_ledger.hpp"
#include "runtime/swap/swap_engine.hpp"
#include "runtime/swap/unit_table.hpp"
#include "runtime/trace.hpp"
#include "storage/checkpoint.hpp"

#include <taskswap/comm.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace taskswap {

struct runtime::impl {
  using unit_record = detail::unit_record;

  impl(const device& dev, const runtime_options& options, const std::vector<unit_spec>& specs,
       std::shared_ptr<communicator> comm);
  ~impl();

  // What the public methods do (runtime.cpp forwards each one through guarded()).
  void plan(std::span<const step_plan> steps);
  unit_view trainer_acquire(unit_id u, stream_view s, unit_use use);
  void trainer_grads_ready(unit_id u, stream_view s);
  void trainer_step(unit_id u, stream_view s);
  void trainer_release(unit_id u, stream_view s);
  /// Returns, for each unit, whether a use of it to reduce was completed (it left idle).
  std::vector<bool> trainer_skip(std::span<const unit_id> units);
  step_stats end_step();
  void flush();
  /// The plan's next homes into the host cache (disk homes), then the next units onto the device.
  void prefetch();
  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user);
  checkpoint_manifest load_checkpoint(const std::filesystem::path& dir);
  runtime_stats stats();
  void write_trace(const std::filesystem::path& file);

  // Registration and start (units/registry.cpp)
  void register_units(const runtime_options& options, const std::vector<unit_spec>& specs);
  void place_homes();
  void start();
  void derive_params();

  // The step protocol's bodies, shared by the trainer's calls and the reducer's updates
  // (step_protocol.cpp)
  // `as_planned`: consume the step's planned acquisition of the unit, if there is one.
  // `m`: the acquisition's move (Note [Unit states]); all but acquire_frozen take the whole slot.
  void acquire(unit_record& r, stream_view s, detail::phase_move m, bool as_planned = true, bool stash = false);
  void apply_step(unit_record& r, stream_view s);
  // Records the release on `s` and makes the move `m` out of the unit's held phase.
  void release(unit_record& r, stream_view s, detail::phase_move m);
  void release_activation(unit_record& r);
  // A unit's AdamW settings for its step, and the settings the step's updates use: those the
  // reduced step began with, or the current ones.
  [[nodiscard]] detail::update_scalars scalars_for(const unit_record& r, const adamw_options& optimizer) const;
  [[nodiscard]] const adamw_options& step_optimizer() const noexcept;
  void check_comm() const;  // with a communicator: its failure, if any, is this call's

  // The host optimizer's path (host_optimizer.cpp). `guarded`: a guarded step's settings.
  void host_step(unit_record& r, const detail::update_scalars& scalars, stream_view s,
                 std::optional<detail::guarded_host_update> guarded = std::nullopt);
  void upload_params(unit_record& r);

  // With a communicator: the replicas start equal (replica_sync.cpp); the rest step_reduction.cpp
  void sync_replicas();
  void begin_step();
  void mark_ready(unit_record& r, stream_view s);
  void on_launched(const std::vector<std::uint32_t>& units);
  void update_on_aux(unit_record& r);
  void hold_for_update(unit_record& r);
  void hold_gradients_only(unit_record& r);
  void complete_step();

  // The step path (Note [Unit states]) and a move of one of a unit's states on it.
  [[nodiscard]] detail::step_path path() const noexcept
  {
    return detail::path_of(reduced_.has_value(), guard_.has_value());
  }
  template <class Move>
  void go(unit_record& r, Move m)
  {
    r.go(m, path());
  }

  // Guarded steps: loss scaling and clipping (step_guard.cpp; their state: detail::guarded_step)
  void defer_update(unit_record& r, stream_view s);
  void defer_release(unit_record& r, stream_view s);
  void finish_guarded_step();
  void guarded_update(unit_record& r, const adamw_options& optimizer);
  loss_scaler_state scaler_state();

  // Failures (runtime_life::guarded): every public call runs through it.
  template <typename Body>
  decltype(auto) guarded(Body&& body)
  {
    return life_.guarded(std::forward<Body>(body));
  }
  // Waits (bounded by the timeout) until the runtime's streams have done their work (lifetime.cpp).
  void wait_streams(std::string_view what);
  // A wait ran out of [runtime] timeout: the device drops its queued work and timeout_error(why)
  // is thrown (lifetime.cpp).
  [[noreturn]] void stalled(const std::string& why);

  // The trace's track of a compute stream, made when the stream is first seen (step_stats.cpp).
  int compute_track(stream_view s);

  device device_;
  runtime_options options_;
  detail::runtime_life life_;  // started, derived, synced, failed (runtime_life.hpp)
  detail::unit_table units_;
  detail::residency_inputs residency_;  // the budget's rules, the plan
  detail::unit_memory memory_;  // homes and the device pool
  // What queued work touches is declared before the streams, so it is destroyed after them (a
  // stream's destruction lets its queued work finish).
  detail::runtime_trace trace_;  // with [runtime] trace
  detail::runtime_streams streams_;
  detail::step_ledger ledger_;  // every counter stats() reports, and the stall timers
  std::optional<detail::swap_engine> swap_;  // residency: made last in the constructor, on the parts above
  std::optional<detail::reduced_step> reduced_;  // with a communicator
  std::optional<detail::guarded_step> guard_;  // with loss scaling or clipping
};

}  // namespace taskswap
