// SPDX-License-Identifier: Apache-2.0
#pragma once

// The runtime's state (runtime::impl), shared by the files that implement it. Who does what:
//   residency/residency_model.cpp  the residency rules the planner shares: budget arithmetic, checks, Belady
//   units/registry.cpp             policies from the rules, registration and its budget checks, homes, start
//   lifetime.cpp                   construction (pool, trace, reducer), waiting for the streams, teardown
//   swap/swap_engine.cpp           residency (detail::swap_engine): fill, write-back, evict, make room, prefetch
//   swap/step_ledger.cpp           the counters stats() reports, stall timers (detail::step_ledger)
//   residency/plan_check.cpp       the plan: per-step budget check, agreement with the other ranks
//   step/step_protocol.cpp         acquire, grads_ready, step, release, skip, end_step
//   step/step_reduction.cpp        the step with a communicator: updates the runtime owns, deferrals
//   step/step_round.hpp            the current step's deferred updates' bookkeeping (detail::step_round)
//   step/host_optimizer.cpp        host placement: gradients home, the CPU AdamW, parameters back up
//   step/step_stats.cpp            runtime::stats (the ledger's counters with the pool's figures), trace tracks
//   step/step_guard.cpp            guarded steps: loss scaling and clipping over the step, updates at end_step
//   homes/runtime_checkpoint.cpp   checkpoint sources, save and load (agreed by the ranks)
//   runtime.cpp                    the public methods, forwarding here through guarded()
//
// Streams: the trainer's compute stream(s); `h2d_` for swap-ins and parameter uploads; `d2h_` for
// write-backs and, for host placement, gradients coming home; `host_opt_` whose host functions
// run the CPU AdamW. Every dependency between them is an event:
//   swap-in:    h2d waits for the events of the units whose memory it reuses (their release, and
//               their write-back or gradient copy), and for the unit's own pending write-back or
//               CPU step (its home copy is being written); then copies and records `arrived`.
//   acquire:    the compute stream waits on `arrived`.
//   release:    records `released` on the compute stream.
//   write-back: d2h waits on `released`, copies home, records `written_back`.
//   host step:  d2h waits on the step's point in the compute stream (`grads_done`), copies the
//               gradients home, zeroes them, records `grads_copied`; host_opt waits, runs the CPU
//               AdamW, records `host_updated`; the next upload of the parameters waits for it.
// Decisions (what to bring in, what to evict, where it goes) are made on the host from the plan
// and never wait for the device.

#include <taskswap/runtime.hpp>

#include "comm/reducer.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"
#include "host/adamw_formula.hpp"
#include "host/step_guard.hpp"
#include "host/host_task_arena.hpp"
#include "storage/checkpoint.hpp"
#include "runtime/pool/device_pool.hpp"
#include "runtime/residency/plan_queue.hpp"
#include "runtime/residency/residency_model.hpp"
#include "runtime/swap/step_ledger.hpp"
#include "runtime/step/guard_memory.hpp"
#include "runtime/step/step_round.hpp"
#include "runtime/swap/swap_engine.hpp"
#include "runtime/runtime_life.hpp"
#include "runtime/trace.hpp"
#include "runtime/swap/unit_record.hpp"

#include <taskswap/comm.hpp>
#include <taskswap/host.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
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

  // Registration (lifetime.cpp)
  void register_units(const runtime_options& options, const std::vector<unit_spec>& specs);
  void place_homes();
  [[nodiscard]] static std::uint64_t identity_of(const unit_record& r);
  void start();
  void derive_params();

  // The residency model's arithmetic (runtime/residency/residency_model.hpp).
  [[nodiscard]] std::size_t taken(std::size_t bytes) const noexcept { return model_->taken(bytes); }
  [[nodiscard]] std::size_t charged(const unit_record& r, std::size_t bytes) const noexcept
  {
    return model_->charged(r.index, bytes);
  }
  [[nodiscard]] std::string granule_note() const { return model_->granule_note(); }
  // What the units held_count_ counts take of the budget (for an error's numbers).
  [[nodiscard]] std::size_t held_bytes() const noexcept;

  // Plan checks (plan_check.cpp)
  // With a communicator, before the ranks agree: the room of a unit this rank trains comes back
  // when its bucket's reduction is launched, at the latest where bucket_reach says.
  void check_step(const step_plan& step, std::uint64_t step_number) const;
  // Disk homes: a warning (once per runtime) for the first planned step whose homes in use at
  // once do not fit the host cache. The step still runs, bitwise the same: it reads them again.
  void check_host_cache(std::span<const step_plan> steps, std::uint64_t first,
                        std::span<const std::vector<std::uint32_t>> frozen_reduced);
  // With a communicator, as agreed: `reduced` the step's agreement, `frozen_reduced` units the
  // step uses frozen here that other ranks train (they take their whole slot), `update_only`
  // units only other ranks train (ready at the step's start).
  void check_agreed_step(const step_plan& step, std::uint64_t step_number, const detail::step_agreement& reduced,
                         std::span<const std::uint32_t> frozen_reduced,
                         std::span<const std::uint32_t> update_only) const;

  // The step protocol's bodies, shared by the trainer's calls and the reducer's updates
  // (step_protocol.cpp)
  // `as_planned`: consume the step's planned acquisition of the unit, if there is one.
  // `m`: the acquisition's move (Note [Unit states]); all but acquire_frozen take the whole slot.
  void acquire(unit_record& r, stream_view s, detail::phase_move m, bool as_planned = true);
  void apply_step(unit_record& r, stream_view s);
  // Records the release on `s` and makes the move `m` out of the unit's held phase.
  void release(unit_record& r, stream_view s, detail::phase_move m);

  // The step paths (Note [Unit states]): what step() and release() do on each.
  void step_local(unit_record& r, stream_view s);
  void step_guarded(unit_record& r, stream_view s);
  void step_reduced(unit_record& r, stream_view s);
  void release_local(unit_record& r, stream_view s);
  void release_local_guarded(unit_record& r, stream_view s);
  void release_reduced(unit_record& r, stream_view s);
  void release_reduced_guarded(unit_record& r, stream_view s);
  // Gives the trainer's gradients up without a step: zero again for the next use.
  void zero_grads(unit_record& r, stream_view s);
  void warn_unstepped(const unit_record& r);

  // A unit's AdamW settings for its step: with weight decay, and without (no-decay tensors).
  struct update_scalars {
    detail::adamw_scalars decay;
    detail::adamw_scalars no_decay;
  };
  [[nodiscard]] update_scalars scalars_for(const unit_record& r, const adamw_options& optimizer) const;

  // The host optimizer's path (host_optimizer.cpp). `guarded`: the scalars come from the unit's
  // step count and the step's factors, which the CPU reads (a skipped step changes nothing).
  struct guarded_host_update {
    adamw_options decay;
    adamw_options plain;
  };
  void host_step(unit_record& r, const update_scalars& scalars, stream_view s,
                 std::optional<guarded_host_update> guarded = std::nullopt);
  void upload_params(unit_record& r);

  // With a communicator (plan_check.cpp: plan_together; step_reduction.cpp: the rest)
  // The steps as planned: each with the units other ranks train that this rank updates, and
  // the units it uses frozen that other ranks train.
  struct together {
    std::vector<step_plan> steps;
    std::vector<std::vector<std::uint32_t>> frozen_reduced;
  };
  together plan_together(std::span<const step_plan> steps);
  // Replicas start equal (replica_sync.cpp)
  void sync_replicas();
  void verify_replicas();
  void broadcast_replicas();
  void begin_step();
  void mark_ready(unit_record& r, stream_view s);
  void on_launched(const std::vector<std::uint32_t>& units);
  void update_on_aux(unit_record& r);
  void hold_for_update(unit_record& r);
  void hold_gradients_only(unit_record& r);
  void complete_step();
  void check_comm() const
  {
    if (reducer_) { reducer_->comm().check(); }
  }

  // Unit states (Note [Unit states]; unit_state_check.cpp): with TASKSWAP_CHECK_STATES=1 every
  // public step call checks that the units are in consistent states and that the one it named
  // moved along the step path's table.
  [[nodiscard]] detail::step_path path() const noexcept
  {
    return detail::path_of(reducer_.has_value(), guard_.has_value());
  }
  // A move of one of the unit's states on this runtime's path.
  template <class Move>
  void go(unit_record& r, Move m)
  {
    r.go(m, path());
  }
  [[nodiscard]] detail::step_phase phase_before(unit_id u) const;
  void check_unit(unit_id u, detail::step_phase before, std::uint32_t moves, const char* call) const;
  void check_units(const char* call, bool step_ended) const;

  // Guarded steps: loss scaling and clipping (step_guard.cpp)
  static void check_scaler(const runtime_options& options);
  [[nodiscard]] static bool guards(const runtime_options& options) noexcept;
  void upload_guard();
  void download_guard();
  void read_guard_steps();
  void defer_update(unit_record& r, stream_view s);
  void defer_release(unit_record& r, stream_view s);
  void finish_guarded_step();
  void guarded_update(unit_record& r, const adamw_options& optimizer);
  loss_scaler_state scaler_state();

  // Checkpoints (runtime_checkpoint.cpp)
  [[nodiscard]] std::vector<detail::checkpoint_source> checkpoint_sources();
  [[nodiscard]] checkpoint_manifest describe(std::span<const detail::checkpoint_source> sources,
                                             const std::map<std::string, std::string>& user);

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

  // Stats (step_stats.cpp; the counters are the ledger's)
  void resolve_stalls(bool wait) { ledger_.resolve_stalls(wait, options_.timeout); }

  unit_record& record(unit_id u)
  {
    TASKSWAP_EXPECTS(u.value < units_.size(), detail::message("unit id ", u.value, " of ", units_.size(), " units"));
    return units_[u.value];
  }
  unit_record& held_record(unit_id u, const char* what)
  {
    unit_record& r = record(u);
    TASKSWAP_EXPECTS(r.phase() != detail::step_phase::release_deferred,
                     detail::message(what, "('", r.name, "'): the unit was released already in this step"));
    TASKSWAP_EXPECTS(r.held() && !r.st.runtime_holds(),
                     detail::message(what, "('", r.name, "'): the unit is not acquired; call acquire first"));
    return r;
  }
  int compute_track(stream_view s);

  device device_;
  runtime_options options_;
  detail::runtime_life life_;  // started, derived, synced, failed (runtime_life.hpp)
  std::deque<unit_record> units_;  // stable addresses: events are referenced from pending waits
  std::unordered_map<std::string, std::uint32_t> by_name_;
  std::optional<detail::residency_model> model_;  // the budget's rules, the plan check, Belady
  detail::home_store homes_;  // where the home tiers keep the homes (Note [Home tiers])
  std::optional<detail::device_pool> pool_;  // taken once the units are known to be valid
  // What queued work touches is declared before the streams, so it is destroyed after them (a
  // stream's destruction lets its queued work finish).
  std::optional<detail::host_task_arena> cpu_;
  std::optional<detail::trace_recorder> trace_;
  stream h2d_;
  stream d2h_;
  stream host_opt_;
  detail::plan_queue plan_;
  std::size_t held_count_ = 0;  // units the trainer holds and those held for an update (not a deferred release)
  std::uint64_t tick_ = 0;
  std::uint64_t planned_steps_ = 0;  // steps appended to the plan, over all time

  detail::step_ledger ledger_;  // every counter stats() reports, and the stall timers
  std::optional<detail::swap_engine> swap_;  // residency: made last in the constructor, on the parts above

  detail::runtime_tracks tracks_;  // the trace's tracks, with a trace

  // With a communicator: the reducer; with one or guarded steps, the stream on which the runtime
  // applies the updates it owns, and the current step's deferred updates (detail::step_round).
  std::optional<stream> aux_;
  detail::step_round round_;
  std::optional<detail::reducer> reducer_;

  // Guarded steps (step_guard.cpp): their memory, device and host (detail::guard_memory).
  std::optional<detail::guard_memory> guard_;
};

}  // namespace taskswap
