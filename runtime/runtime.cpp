// SPDX-License-Identifier: Apache-2.0
// The runtime: unit registry, residency, the plan-driven prefetch scheduler and the step protocol.
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

#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/log.hpp"
#include "device/message.hpp"
#include "host/cpu_adamw.hpp"
#include "host/host_task_arena.hpp"
#include "kernels/kernels.hpp"
#include "runtime/checkpoint.hpp"
#include "runtime/crc32c.hpp"
#include "runtime/device_pool.hpp"
#include "runtime/plan_queue.hpp"
#include "runtime/trace.hpp"
#include "runtime/unit_layout.hpp"

#include <taskswap/comm.hpp>
#include <taskswap/host.hpp>

#include <fnmatch.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <unordered_map>

namespace taskswap {

std::string_view to_string(residency r) noexcept
{
  switch (r) {
    case residency::pinned: return "pinned";
    case residency::on_demand: return "on_demand";
    case residency::prefetch: break;
  }
  return "prefetch";
}

std::string_view to_string(optimizer_placement p) noexcept
{
  return p == optimizer_placement::host ? "host" : "device";
}

void* unit_view::param(std::size_t i) const
{
  TASKSWAP_EXPECTS(i < tensors.size(), detail::message("tensor ", i, " of a unit with ", tensors.size()));
  return static_cast<std::byte*>(params.data) + tensors[i].offset * size_of(params.type);
}

void* unit_view::grad(std::size_t i) const
{
  TASKSWAP_EXPECTS(i < tensors.size(), detail::message("tensor ", i, " of a unit with ", tensors.size()));
  return static_cast<std::byte*>(grads.data) + tensors[i].offset * size_of(grads.type);
}

step_plan::step_plan(std::initializer_list<unit_id> acquisitions)
    : step_plan(std::span<const unit_id>(acquisitions.begin(), acquisitions.size()))
{
}

step_plan::step_plan(std::span<const unit_id> acquisitions)
{
  entries_.reserve(acquisitions.size());
  for (const unit_id u : acquisitions) { entries_.push_back({u, true}); }
}

step_plan& step_plan::acquire(unit_id u)
{
  entries_.push_back({u, true});
  return *this;
}

step_plan& step_plan::release(unit_id u)
{
  entries_.push_back({u, false});
  return *this;
}

namespace {

using detail::bytes_text;
using detail::message;

constexpr std::size_t stats_history = 4096;

struct unit_record {
  std::string name;
  unit_policy policy;
  detail::unit_layout layout;
  std::byte* home = nullptr;  // the unit's block in the pinned arena
  std::optional<device_span> slot;
  bool held = false;
  bool dirty = false;         // the device copy is newer than home (device placement)
  bool params_stale = false;  // home is newer than the device copy (host placement, after a step)
  bool stepped_here = false;  // a host step read this residency's gradients
  bool stepped = false;       // step() since its acquire (without a communicator)
  std::int64_t step = 0;
  std::uint64_t last_release = 0;
  std::size_t resident_index = 0;  // in runtime::impl::resident_
  std::size_t swap_ins = 0;
  std::size_t write_backs = 0;
  event arrived;
  event released;
  std::optional<event> grads_ready_event;
  std::optional<event> written_back;
  std::optional<event> grads_done;
  std::optional<event> grads_copied;
  std::optional<event> host_updated;
  std::size_t trace_span = 0;
  std::uint32_t index = 0;  // its unit_id
  // With a communicator, within the current step:
  bool update_only = false;     // acquired by the runtime to apply an update other ranks trained
  bool step_requested = false;  // step() was called (or the runtime stepped it)
  bool step_deferred = false;   // step() came before its reduction was launched; the update waits
  bool updated_on_aux = false;  // its update ran on the runtime's aux stream
  bool release_deferred = false;  // the trainer released it before the deferred update ran
  void* released_on = nullptr;    // the stream of its last release: a user on another one waits for it
  bool grads_only = false;        // its slot holds only a gradient slab (host placement, update only)
  std::optional<event> step_point;        // the trainer's stream at step()
  std::optional<event> trainer_released;  // the trainer's stream at release()

  unit_record(const device& dev, std::uint32_t i, std::string n, unit_policy p, detail::unit_layout l)
      : name(std::move(n)), policy(p), layout(std::move(l)), arrived(dev), released(dev), index(i)
  {
  }
  [[nodiscard]] bool resident() const noexcept { return slot.has_value(); }
  [[nodiscard]] bool pinned() const noexcept { return policy.residency == residency::pinned; }
  /// Where the gradients start in its slot.
  [[nodiscard]] std::size_t grads_at() const noexcept { return grads_only ? 0 : layout.device_grads; }
};

unit_state state_of(const unit_record& r) noexcept
{
  return r.held ? unit_state::held : r.resident() ? unit_state::resident : unit_state::home;
}

event& ensure(std::optional<event>& e, const device& dev)
{
  if (!e) { e.emplace(dev); }
  return *e;
}

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
  }
  return p;
}

std::string policy_hint(const unit_record& r)
{
  return r.policy.optimizer == optimizer_placement::device
           ? "raise [device] budget or choose optimizer = \"host\" for it"
           : "raise [device] budget";
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
                        .param_bytes = l.master == l.params ? l.m - l.params : l.master - l.params};
}

struct runtime::impl {
  impl(const device& dev, const runtime_options& options, std::vector<unit_spec> specs,
       std::shared_ptr<communicator> comm);
  ~impl();

  // Registration
  void register_units(const runtime_options& options, std::vector<unit_spec> specs);
  void place_homes();
  void start();

  // Residency
  bool swap_in(unit_record& r, std::uint64_t use, bool for_acquire);
  void fill_slot(unit_record& r);
  std::optional<device_span> make_room(std::size_t bytes, std::uint64_t use, bool for_acquire);
  unit_record* pick_victim(std::uint64_t use, bool for_acquire);
  void evict(unit_record& r);
  void write_back(unit_record& r);
  void upload_params(unit_record& r);
  void flush_h2d_waits();
  void prefetch();
  void add_resident(unit_record& r);
  void remove_resident(unit_record& r);
  void note_device_bytes();

  // Plan checks
  void check_step(const step_plan& step, std::uint64_t step_number) const;

  // The step protocol's bodies (shared by the trainer's calls and the reducer's updates)
  void acquire(unit_record& r, stream_view s);
  void apply_step(unit_record& r, stream_view s);
  void release(unit_record& r, stream_view s);

  // With a communicator
  void plan_together(std::span<const step_plan> steps);
  void begin_step();
  void mark_ready(unit_record& r, stream_view s);
  void on_launched(const std::vector<std::uint32_t>& units);
  void update_on_aux(unit_record& r);
  void hold_for_update(unit_record& r);
  void hold_gradients_only(unit_record& r);
  void complete_step();
  void reset_step_flags(unit_record& r);
  void check_comm() const
  {
    if (reducer_) { reducer_->comm().check(); }
  }

  // Checkpoints
  [[nodiscard]] std::vector<detail::checkpoint_source> checkpoint_sources();
  [[nodiscard]] checkpoint_manifest describe(std::span<const detail::checkpoint_source> sources,
                                             const std::map<std::string, std::string>& user);

  // Failures. After the device failed, a wait timed out or a collective failed, every later call
  // throws that first error again, and the runtime writes nothing home any more: a unit on the
  // device may hold work that never finished, or an update from gradients that never arrived.
  template <typename Body>
  decltype(auto) guarded(Body&& body)
  {
    if (failed_) { std::rethrow_exception(failed_); }
    try {
      return body();
    } catch (const device_error&) {
      failed_ = std::current_exception();
      throw;
    } catch (const timeout_error&) {
      failed_ = std::current_exception();
      throw;
    } catch (const comm_error&) {
      failed_ = std::current_exception();
      throw;
    } catch (const cuda_error&) {  // a sticky CUDA error surfaces as the first call's failure
      failed_ = std::current_exception();
      throw;
    }
  }
  // Waits (bounded by the timeout) until the runtime's streams have done their work.
  void wait_streams(std::string_view what);
  std::exception_ptr failed_;
  bool load_failed_ = false;  // failed_ is a load that overwrote part of the home copies

  // Stats
  void resolve_stalls(bool wait);
  step_stats* stats_of(std::uint64_t step);

  unit_record& record(unit_id u)
  {
    TASKSWAP_EXPECTS(u.value < units_.size(), message("unit id ", u.value, " of ", units_.size(), " units"));
    return units_[u.value];
  }
  unit_record& held_record(unit_id u, const char* what)
  {
    unit_record& r = record(u);
    TASKSWAP_EXPECTS(r.held, message(what, "('", r.name, "'): the unit is not acquired; call acquire first"));
    return r;
  }
  int compute_track(stream_view s);

  device device_;
  runtime_options options_;
  std::deque<unit_record> units_;  // stable addresses: events are referenced from pending waits
  std::unordered_map<std::string, std::uint32_t> by_name_;
  std::size_t pinned_bytes_ = 0;
  std::size_t largest_swapped_ = 0;
  std::optional<pinned_arena> arena_;
  std::optional<detail::device_pool> pool_;  // taken once the units are known to be valid
  // What queued work touches is declared before the streams, so it is destroyed after them (a
  // stream's destruction lets its queued work finish).
  std::optional<detail::host_task_arena> cpu_;
  std::optional<detail::trace_recorder> trace_;
  stream h2d_;
  stream d2h_;
  stream host_opt_;
  detail::plan_queue plan_;
  std::size_t max_lookahead_ = 0;
  std::vector<std::uint32_t> resident_;  // non-pinned resident units
  std::vector<const event*> h2d_waits_;  // must precede the next write into pool memory
  std::size_t held_count_ = 0;
  std::size_t held_bytes_ = 0;
  std::uint64_t tick_ = 0;
  std::uint64_t steps_done_ = 0;
  std::uint64_t planned_steps_ = 0;  // steps appended to the plan, over all time
  bool started_ = false;

  step_stats current_{};
  step_stats total_{};
  std::deque<step_stats> history_;
  struct stall_timer {
    event begin;
    event end;
    std::uint64_t step = 0;
  };
  std::vector<stall_timer> stalls_pending_;
  std::vector<stall_timer> stalls_free_;

  int h2d_track_ = 0;
  int d2h_track_ = 0;
  int host_track_ = 0;
  std::unordered_map<void*, int> compute_tracks_;

  // With a communicator: the reducer, the agreed upcoming steps (front: the current one) and the
  // stream on which the runtime applies the updates it owns.
  struct agreed_step {
    detail::step_agreement agreement;
    std::vector<std::uint32_t> update_only;  // active elsewhere, not trained here
  };
  std::optional<stream> aux_;
  std::deque<agreed_step> agreed_;
  bool step_begun_ = false;
  adamw_options step_optimizer_{};  // the optimizer settings of the current step
  std::vector<std::uint32_t> step_units_;  // units with per-step flags set, to reset at end_step
  std::optional<detail::reducer> reducer_;
};

runtime::impl::impl(const device& dev, const runtime_options& options, std::vector<unit_spec> specs,
                    std::shared_ptr<communicator> comm)
    : device_(dev),
      options_(options),
      h2d_(dev),
      d2h_(dev),
      host_opt_(dev),
      plan_(specs.size())
{
  register_units(options, std::move(specs));
  pool_.emplace(dev, options.device.budget);
  place_homes();
  if (options_.trace) {
    trace_.emplace(device_, h2d_.view());
    h2d_track_ = trace_->track("h2d (swap-in)");
    d2h_track_ = trace_->track("d2h (write-back)");
    host_track_ = trace_->track("host optimizer");
  }
  if (!comm) { comm = make_communicator(dev, options.comm); }
  if (comm) {
    std::vector<detail::reducer_unit> units;
    units.reserve(units_.size());
    for (const unit_record& r : units_) {
      const detail::unit_layout& l = r.layout;
      std::uint64_t digest = 0xcbf29ce484222325ULL;
      for (const tensor_info& t : l.tensors) {
        digest = detail::fnv1a(digest, t.name);
        for (const std::size_t d : t.shape) { digest = detail::fnv1a(digest, message(",", d)); }
      }
      digest = detail::fnv1a(digest, message(to_string(l.compute), "/", to_string(l.grad)));
      units.push_back({r.name, l.count * size_of(l.grad), l.grad, digest});
    }
    aux_.emplace(dev);
    reducer_.emplace(dev, std::move(comm), options.comm, std::move(units));
  }
}

runtime::impl::~impl()
{
  // Keep the home copies current (unless something failed: then nothing more is written home)
  // and let no copy outlive the memory it touches.
  const bool failed = failed_ || (reducer_ && reducer_->comm().failed());
  if (failed) {
    detail::log(log_level::warning, "runtime teardown after a failure: dirty units are not written back; the home "
                                    "copies hold the states last written back");
  }
  try {
    if (held_count_ == 0 && started_ && !failed) {
      for (unit_record& r : units_) {
        if (r.resident() && r.dirty) { write_back(r); }
      }
    }
  } catch (const std::exception& e) {
    detail::log(log_level::warning, message("runtime teardown: writing dirty units back failed: ", e.what()));
  }
  try {
    wait_streams("runtime teardown");
  } catch (const std::exception& e) {
    detail::log(log_level::warning, e.what());
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  for (unit_record& r : units_) {
    try {
      const auto left = std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero());
      if (r.released.recorded() && !r.released.synchronize_for(left)) {
        detail::log(log_level::warning, message("runtime teardown: unit '", r.name, "' was not released on the device within ",
                                                options_.timeout.count(), " ms; the trainer's stream is stalled"));
        break;
      }
    } catch (const std::exception& e) {
      detail::log(log_level::warning, message("runtime teardown: unit '", r.name, "': ", e.what()));
    }
  }
  // The device memory and the home arena are freed next, and queued work may still touch them:
  // freeing waits for the device (as cudaFree does), after a stall until the stalled work ends.
}

void runtime::impl::register_units(const runtime_options& options, std::vector<unit_spec> specs)
{
  if (specs.empty()) { throw config_error("taskswap runtime: no units given; register at least one unit"); }
  std::vector<bool> rule_used(options.units.size(), false);
  for (unit_spec& spec : specs) {
    if (spec.name.empty()) { throw config_error("taskswap runtime: a unit has an empty name; name every unit"); }
    const unit_policy policy = resolve_policy(spec, options, rule_used);
    if (policy.lookahead < 0) {
      throw config_error(message("unit '", spec.name, "': lookahead ", policy.lookahead, " is negative; use 0 or more"));
    }
    if (!by_name_.emplace(spec.name, static_cast<std::uint32_t>(units_.size())).second) {
      throw config_error(message("unit '", spec.name, "' is registered twice; unit names must be unique"));
    }
    units_.emplace_back(device_, static_cast<std::uint32_t>(units_.size()), spec.name, policy, detail::make_unit_layout(spec, policy.optimizer));
    unit_record& r = units_.back();
    if (r.pinned()) {
      pinned_bytes_ += r.layout.device_bytes;
    } else {
      largest_swapped_ = std::max(largest_swapped_, r.layout.device_bytes);
      if (policy.residency == residency::prefetch) {
        max_lookahead_ = std::max(max_lookahead_, static_cast<std::size_t>(policy.lookahead));
      }
    }
  }
  for (std::size_t i = 0; i < rule_used.size(); ++i) {
    if (!rule_used[i]) {
      const unit_rule& rule = options.units[i];
      throw config_error(message(rule.origin.empty() ? options.source : rule.origin, ": [[units]] match = \"",
                                 rule.match, "\" matches no registered unit; fix the pattern or remove the rule"));
    }
  }
  const std::size_t budget = options.device.budget;
  if (pinned_bytes_ > budget) {
    throw config_error(message("the pinned units need ", bytes_text(pinned_bytes_), " of device memory but the budget is ",
                               bytes_text(budget), "; raise [device] budget or pin fewer units"));
  }
  for (const unit_record& r : units_) {
    if (!r.pinned() && r.layout.device_bytes > budget - pinned_bytes_) {
      throw config_error(message("unit '", r.name, "' needs ", bytes_text(r.layout.device_bytes),
                                 " of device memory but the budget leaves ", bytes_text(budget - pinned_bytes_),
                                 " after pinned units; ", policy_hint(r)));
    }
  }
}

void runtime::impl::place_homes()
{
  std::size_t total = 0;
  bool any_host = false;
  for (const unit_record& r : units_) {
    total += r.layout.home_bytes;
    any_host = any_host || r.policy.optimizer == optimizer_placement::host;
  }
  pinned_arena_options o;
  o.bytes = total;
  o.numa_node = options_.host.numa_node;
  o.huge_pages = options_.host.huge_pages;
  arena_.emplace(device_, o);
  for (unit_record& r : units_) { r.home = arena_->allocate(r.layout.home_bytes, detail::slab_alignment).data(); }
  if (any_host) { cpu_.emplace(static_cast<int>(arena_->numa_node()), options_.host.optimizer_threads); }
  // Pinned units take the bottom of the pool, where they never fragment what swaps.
  for (unit_record& r : units_) {
    if (r.pinned()) { r.slot = pool_->allocate(r.layout.device_bytes, detail::slab_alignment); }
  }
}

// Runs before the first plan or acquire, so the trainer can initialise the home copies first.
void runtime::impl::start()
{
  if (started_) { return; }
  started_ = true;
  for (unit_record& r : units_) {
    const detail::unit_layout& l = r.layout;
    if (l.compute != dtype::f32) {  // the master is the source of truth; derive the params from it
      detail::host_cast(r.home + l.params, l.compute, r.home + l.master, dtype::f32, l.count);
    }
    if (r.pinned()) { fill_slot(r); }
  }
}


// ---- residency -------------------------------------------------------------------------------

void runtime::impl::flush_h2d_waits()
{
  for (const event* e : h2d_waits_) {
    if (!e->query()) { e->wait(h2d_); }  // a finished event orders nothing: skip the enqueue
  }
  h2d_waits_.clear();
}

void runtime::impl::note_device_bytes()
{
  const std::size_t used = pool_->stats().used;
  current_.peak_device_bytes = std::max(current_.peak_device_bytes, used);
  if (trace_) { trace_->counter("device bytes", static_cast<double>(used)); }
}

void runtime::impl::add_resident(unit_record& r)
{
  r.resident_index = resident_.size();
  resident_.push_back(r.index);
}

void runtime::impl::remove_resident(unit_record& r)
{
  const std::uint32_t last = resident_.back();
  resident_[r.resident_index] = last;
  units_[last].resident_index = r.resident_index;
  resident_.pop_back();
}

// Copies the travelling prefix of the home block into the unit's slot and zeroes its gradients,
// on h2d, after every pending reuse of pool memory and every pending write of this home block.
void runtime::impl::fill_slot(unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  flush_h2d_waits();
  for (const std::optional<event>* e : {&r.written_back, &r.host_updated}) {
    if (*e && (*e)->recorded() && !(*e)->query()) { (*e)->wait(h2d_); }
  }
  const std::size_t span = trace_ ? trace_->open(h2d_track_, "swap-in " + r.name, h2d_) : 0;
  copy_async(r.slot->subspan(0, l.travel_bytes), std::span<const std::byte>(r.home, l.travel_bytes), h2d_);
  fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, h2d_);
  r.arrived.record(h2d_);
  if (trace_) { trace_->close(span, h2d_); }
  r.dirty = false;
  r.params_stale = false;
  r.stepped_here = false;
  ++r.swap_ins;
  ++current_.swap_ins;
  current_.h2d_bytes += l.travel_bytes;
}

// After a host step: the new parameters go up once the CPU AdamW wrote them and the trainer let
// go of the old ones.
void runtime::impl::upload_params(unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  flush_h2d_waits();
  r.released.wait(h2d_);
  r.host_updated->wait(h2d_);
  const std::size_t span = trace_ ? trace_->open(h2d_track_, "params " + r.name, h2d_) : 0;
  copy_async(r.slot->subspan(0, l.travel_bytes), std::span<const std::byte>(r.home, l.travel_bytes), h2d_);
  r.arrived.record(h2d_);
  if (trace_) { trace_->close(span, h2d_); }
  r.params_stale = false;
  current_.h2d_bytes += l.travel_bytes;
}

void runtime::impl::write_back(unit_record& r)
{
  const detail::unit_layout& l = r.layout;
  if (r.released.recorded() && !r.released.query()) { r.released.wait(d2h_); }
  const std::size_t span = trace_ ? trace_->open(d2h_track_, "write-back " + r.name, d2h_) : 0;
  copy_async(std::span<std::byte>(r.home, l.writeback_bytes), const_device_span(r.slot->subspan(0, l.writeback_bytes)),
             d2h_);
  ensure(r.written_back, device_).record(d2h_);
  if (trace_) { trace_->close(span, d2h_); }
  r.dirty = false;
  ++r.write_backs;
  ++current_.write_backs;
  current_.d2h_bytes += l.writeback_bytes;
}

void runtime::impl::evict(unit_record& r)
{
  if (r.dirty) {
    write_back(r);
    h2d_waits_.push_back(&*r.written_back);  // recorded after d2h waited for the release
  } else {
    if (r.released.recorded()) { h2d_waits_.push_back(&r.released); }
    if (r.stepped_here) { h2d_waits_.push_back(&*r.grads_copied); }
  }
  pool_->deallocate(*r.slot);
  r.slot.reset();
  r.grads_only = false;
  r.params_stale = false;
  remove_resident(r);
  ++current_.evictions;
  note_device_bytes();
}

// Belady: the unit used furthest in the future, least recently released among equals.
// An acquire (a use now) may take any unit not held. A prefetch for the use at `use` is
// conservative (Cao et al., 1995): it displaces the unit that Belady would displace when `use`
// comes, and only if that unit is neither held nor needed before then; otherwise it waits. So
// prefetching moves fetches earlier but never adds one.
unit_record* runtime::impl::pick_victim(std::uint64_t use, bool for_acquire)
{
  unit_record* best = nullptr;
  std::uint64_t best_use = 0;
  for (const std::uint32_t i : resident_) {
    unit_record& r = units_[i];
    if (for_acquire && r.held) { continue; }
    const std::uint64_t next = for_acquire ? plan_.next_use(unit_id{i}) : plan_.next_use_after(unit_id{i}, use);
    if (best == nullptr || next > best_use || (next == best_use && r.last_release < best->last_release)) {
      best = &r;
      best_use = next;
    }
  }
  if (best != nullptr && !for_acquire && (best->held || plan_.next_use(unit_id{best->index}) < use)) {
    return nullptr;
  }
  return best;
}

std::optional<device_span> runtime::impl::make_room(std::size_t bytes, std::uint64_t use, bool for_acquire)
{
  while (true) {
    if (auto range = pool_->try_allocate(bytes, detail::slab_alignment)) { return range; }
    unit_record* victim = pick_victim(use, for_acquire);
    if (victim == nullptr) { return std::nullopt; }
    evict(*victim);
  }
}

bool runtime::impl::swap_in(unit_record& r, std::uint64_t use, bool for_acquire)
{
  auto range = make_room(r.layout.device_bytes, use, for_acquire);
  if (!range) { return false; }
  r.slot = *range;
  add_resident(r);
  fill_slot(r);
  note_device_bytes();
  return true;
}

// Brings in the upcoming units in the order of their use, as far as each one's lookahead and the
// budget allow; stops at the first that does not fit, so no later unit takes its room.
void runtime::impl::prefetch()
{
  plan_.for_each_upcoming(max_lookahead_, [&](unit_id u, std::uint64_t position, std::size_t distance) {
    unit_record& r = units_[u.value];
    if (r.resident() || r.policy.residency != residency::prefetch) { return true; }
    if (distance > static_cast<std::size_t>(r.policy.lookahead)) { return true; }
    return swap_in(r, position, false);
  });
}

// ---- plan -----------------------------------------------------------------------------------

void runtime::impl::check_step(const step_plan& step, std::uint64_t step_number) const
{
  std::vector<std::uint32_t> held;
  std::size_t held_bytes = 0;
  const std::size_t budget = options_.device.budget;
  const auto held_names = [&] {
    std::string s;
    for (const std::uint32_t i : held) { s += (s.empty() ? "'" : ", '") + units_[i].name + "'"; }
    return s;
  };
  for (const step_plan::entry& e : step.entries()) {
    if (e.unit.value >= units_.size()) {
      throw config_error(message("plan step ", step_number, ": unit id ", e.unit.value, " is not registered (",
                                 units_.size(), " units)"));
    }
    const unit_record& r = units_[e.unit.value];
    const auto it = std::find(held.begin(), held.end(), e.unit.value);
    if (!e.acquire) {
      if (it == held.end()) {
        throw config_error(message("plan step ", step_number, ": releases '", r.name,
                                   "', which the step has not acquired; acquire it earlier in the step"));
      }
      held.erase(it);
      // With a communicator a released unit may keep its room until its bucket is reduced, which
      // can wait for units acquired later in the step: count it to the end of the step.
      if (!r.pinned() && !reducer_) { held_bytes -= r.layout.device_bytes; }
      continue;
    }
    if (it != held.end()) {
      throw config_error(message("plan step ", step_number, ": acquires '", r.name,
                                 "' while it is still held; release it in between"));
    }
    if (r.pinned()) {
      held.push_back(e.unit.value);
      continue;
    }
    // Free room splits into at most one hole more than there are held units; when the largest
    // hole is sure to hold the unit, no placement of the held units can make the acquire fail.
    const std::size_t swapped_held = static_cast<std::size_t>(
      std::count_if(held.begin(), held.end(), [&](std::uint32_t i) { return !units_[i].pinned(); }));
    const std::size_t free = budget - pinned_bytes_ - std::min(held_bytes, budget - pinned_bytes_);
    if (free >= r.layout.device_bytes && free / (swapped_held + 1) < r.layout.device_bytes) {
      detail::log_once("plan fragmentation margin", log_level::warning,
                       message("plan step ", step_number, ": acquiring '", r.name, "' (", bytes_text(r.layout.device_bytes),
                               ") next to ", swapped_held, " held units leaves ", bytes_text(free),
                               " free; if the held units split it, the acquire fails with out_of_memory. A budget "
                               "with ", bytes_text((swapped_held + 1) * r.layout.device_bytes - free),
                               " more is safe whatever the placement"));
    }
    held.push_back(e.unit.value);
    held_bytes += r.layout.device_bytes;
    if (pinned_bytes_ + held_bytes > budget) {
      throw config_error(message("plan step ", step_number, ": after acquiring '", r.name, "' the units held at once (",
                                 held_names(), ") need ", bytes_text(held_bytes), " and the pinned units ",
                                 bytes_text(pinned_bytes_), ", together ", bytes_text(pinned_bytes_ + held_bytes),
                                 " of a ", bytes_text(budget),
                                 " budget; release units earlier in the step, raise [device] budget or choose "
                                 "optimizer = \"host\"",
                                 reducer_ ? " (with a communicator, units released within a step count until it ends)"
                                          : ""));
    }
  }
}

// ---- with a communicator ----------------------------------------------------------------------

// Agrees with the other ranks on the steps' units, then plans each step with the units other
// ranks train and this one does not acquired first (this rank applies their update too) and
// released at its end, and checks the budget again with them.
void runtime::impl::plan_together(std::span<const step_plan> steps)
{
  const std::uint64_t first = steps_done_ + plan_.planned_steps();
  std::vector<std::vector<std::uint32_t>> local(steps.size());
  for (std::size_t k = 0; k < steps.size(); ++k) {
    for (const step_plan::entry& e : steps[k].entries()) {
      if (!e.acquire) { continue; }
      if (std::find(local[k].begin(), local[k].end(), e.unit.value) != local[k].end()) {
        throw config_error(message("plan step ", first + k, ": acquires '", units_[e.unit.value].name,
                                   "' twice. With a communicator a unit is acquired once per step and held from "
                                   "forward through backward (its release is the end of its gradients); release "
                                   "and re-acquire within a step only without a communicator"));
      }
      local[k].push_back(e.unit.value);
    }
  }
  std::vector<detail::step_agreement> agreed = reducer_->agree(local, first);
  std::vector<step_plan> full_steps(steps.size());
  std::vector<agreed_step> agreed_steps;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    agreed_step a{std::move(agreed[k]), {}};
    for (const std::uint32_t u : a.agreement.order) {
      if (std::find(local[k].begin(), local[k].end(), u) == local[k].end()) { a.update_only.push_back(u); }
    }
    std::sort(a.update_only.begin(), a.update_only.end());
    step_plan full;
    for (const std::uint32_t u : a.update_only) { full.acquire(unit_id{u}); }
    for (const step_plan::entry& e : steps[k].entries()) {
      if (e.acquire) {
        full.acquire(e.unit);
      } else {
        full.release(e.unit);
      }
    }
    for (const std::uint32_t u : a.update_only) { full.release(unit_id{u}); }
    try {
      if (!a.update_only.empty()) { check_step(full, first + k); }  // else plan() checked it as given
    } catch (const config_error& e) {
      std::string others;
      for (const std::uint32_t u : a.update_only) { others += (others.empty() ? "'" : ", '") + units_[u].name + "'"; }
      throw config_error(message(e.what(), others.empty() ? "" : ". The step includes units other ranks train (",
                                 others, others.empty() ? "" : "), which this rank holds for their update"));
    }
    full_steps[k] = std::move(full);
    agreed_steps.push_back(std::move(a));
  }
  for (std::size_t k = 0; k < steps.size(); ++k) {  // all checked: nothing is planned half
    plan_.append(full_steps[k]);
    agreed_.push_back(std::move(agreed_steps[k]));
  }
}

// The current step's reduction starts once it is planned: the units this rank only updates are
// acquired on aux with zero gradients, ready for their buckets.
void runtime::impl::begin_step()
{
  if (!reducer_ || step_begun_ || agreed_.empty()) { return; }
  step_begun_ = true;
  step_optimizer_ = options_.optimizer;
  reducer_->begin(agreed_.front().agreement, steps_done_);
  for (const std::uint32_t u : agreed_.front().update_only) { hold_for_update(units_[u]); }
}

// A unit this rank updates without training it: it contributes zero gradients and applies the
// reduced ones. With host placement, unless it is resident anyway, only a zeroed gradient slab
// exists on the device: the gradient goes home and the CPU updates it; no parameters travel.
void runtime::impl::hold_for_update(unit_record& r)
{
  if (r.policy.optimizer == optimizer_placement::host && !r.resident()) {
    hold_gradients_only(r);
  } else {
    acquire(r, *aux_);
    fill_async(r.slot->subspan(r.grads_at(), r.layout.device_grad_bytes()), std::byte{0}, *aux_);
  }
  r.update_only = true;
  r.step_requested = true;
  mark_ready(r, *aux_);
}

void runtime::impl::hold_gradients_only(unit_record& r)
{
  const std::optional<std::uint64_t> position = plan_.match(unit_id{r.index});
  const std::size_t bytes = r.layout.device_grad_bytes();
  const auto range = make_room(bytes, position.value_or(0), true);
  if (!range) {
    throw out_of_memory(message("step ", steps_done_, ": the zeroed gradient slab of '", r.name, "' (",
                                bytes_text(bytes), "), which other ranks train, does not fit in the ",
                                bytes_text(options_.device.budget), " budget beside the units held; raise [device] budget"),
                        bytes, options_.device.budget - pool_->stats().used, options_.device.budget);
  }
  r.slot = *range;
  r.grads_only = true;
  add_resident(r);
  flush_h2d_waits();  // the pool memory's previous users are done with it
  fill_async(*r.slot, std::byte{0}, h2d_);
  r.arrived.record(h2d_);
  r.arrived.wait(*aux_);
  r.held = true;
  ++held_count_;
  held_bytes_ += r.layout.device_bytes;
  step_units_.push_back(r.index);
  note_device_bytes();
}

void runtime::impl::mark_ready(unit_record& r, stream_view s)
{
  if (reducer_->is_ready(r.index)) { return; }  // the reduction waits for the first ready point
  ensure(r.grads_ready_event, device_).record(s);
  // The tensors' elements only: the slab's alignment padding is never sent.
  const std::size_t bytes = r.layout.count * size_of(r.layout.grad);
  on_launched(reducer_->ready(r.index, r.slot->subspan(r.grads_at(), bytes), *r.grads_ready_event));
}

void runtime::impl::on_launched(const std::vector<std::uint32_t>& units)
{
  for (const std::uint32_t u : units) {
    unit_record& r = units_[u];
    if (r.update_only || r.step_deferred) { update_on_aux(r); }
  }
}

// The update of a unit whose reduction was launched after the trainer's step() (or that only
// this runtime holds): on aux, after the trainer's stream reached step() and the reduction.
void runtime::impl::update_on_aux(unit_record& r)
{
  stream& aux = *aux_;
  if (r.step_deferred && !r.step_point->query()) { r.step_point->wait(aux); }
  const event* reduced = reducer_->reduced(r.index);
  if (!reduced->query()) { reduced->wait(aux); }
  apply_step(r, aux);
  r.step_deferred = false;
  r.updated_on_aux = true;
  if (r.release_deferred) {
    if (!r.trainer_released->query()) { r.trainer_released->wait(aux); }
    release(r, aux);
  } else if (r.update_only) {
    release(r, aux);
  }
}

// Units planned here but never acquired still count as trained by this rank: they contribute
// zeros and take the update, as units only other ranks trained do.
void runtime::impl::complete_step()
{
  for (const std::uint32_t u : reducer_->not_ready()) {
    unit_record& r = units_[u];
    if (r.held) { continue; }  // the trainer still holds it: end_step reports that
    hold_for_update(r);
  }
}

void runtime::impl::reset_step_flags(unit_record& r)
{
  r.update_only = false;
  r.step_requested = false;
  r.step_deferred = false;
  r.updated_on_aux = false;
  r.release_deferred = false;
}

// ---- stats ----------------------------------------------------------------------------------

step_stats* runtime::impl::stats_of(std::uint64_t step)
{
  if (step == steps_done_) { return &current_; }
  const std::uint64_t oldest = steps_done_ - history_.size();
  return step >= oldest ? &history_[step - oldest] : nullptr;
}

void runtime::impl::resolve_stalls(bool wait)
{
  auto it = stalls_pending_.begin();
  while (it != stalls_pending_.end()) {
    if (wait && !it->end.synchronize_for(options_.timeout)) {
      throw timeout_error(message("flush: a swap-in's stall timer on the trainer's stream has not completed within ",
                                  options_.timeout.count(), " ms ([runtime] timeout): the trainer's stream is stalled"));
    }
    if (!it->end.query()) {
      ++it;
      continue;
    }
    const double ms = elapsed_ms(it->begin, it->end);
    if (step_stats* s = stats_of(it->step)) { s->stall_ms += ms; }
    if (it->step != steps_done_) { total_.stall_ms += ms; }
    stalls_free_.push_back(std::move(*it));
    it = stalls_pending_.erase(it);
  }
}

int runtime::impl::compute_track(stream_view s)
{
  const auto [it, inserted] = compute_tracks_.try_emplace(s.native_handle(), 0);
  if (inserted) { it->second = trace_->track("compute " + std::to_string(compute_tracks_.size())); }
  return it->second;
}

// ---- runtime --------------------------------------------------------------------------------

runtime::runtime(const device& dev, const runtime_options& options, std::vector<unit_spec> units)
    : impl_(std::make_unique<impl>(dev, options, std::move(units), nullptr))
{
}

runtime::runtime(const device& dev, const runtime_options& options, std::vector<unit_spec> units,
                 std::shared_ptr<communicator> comm)
    : impl_(std::make_unique<impl>(dev, options, std::move(units), std::move(comm)))
{
}

runtime::~runtime() = default;
runtime::runtime(runtime&&) noexcept = default;
runtime& runtime::operator=(runtime&&) noexcept = default;

unit_id runtime::find(std::string_view name) const
{
  const auto it = impl_->by_name_.find(std::string(name));
  TASKSWAP_EXPECTS(it != impl_->by_name_.end(), message("no unit is named '", name, "'"));
  return unit_id{it->second};
}

std::size_t runtime::unit_count() const noexcept { return impl_->units_.size(); }
std::string_view runtime::name(unit_id u) const { return impl_->record(u).name; }
const unit_policy& runtime::policy(unit_id u) const { return impl_->record(u).policy; }
std::size_t runtime::device_bytes(unit_id u) const { return impl_->record(u).layout.device_bytes; }

unit_state runtime::state(unit_id u) const
{
  return state_of(impl_->record(u));
}

home_view runtime::home(unit_id u)
{
  unit_record& r = impl_->record(u);
  const detail::unit_layout& l = r.layout;
  home_view v;
  v.id = u;
  v.tensors = l.tensors;
  v.params = {r.home + l.params, l.compute, l.count};
  v.master = {r.home + l.master, dtype::f32, l.count};
  v.m = {r.home + l.m, dtype::f32, l.count};
  v.v = {r.home + l.v, dtype::f32, l.count};
  v.step = r.step;
  return v;
}

void runtime::plan(std::span<const step_plan> steps)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    m.check_comm();
    for (std::size_t k = 0; k < steps.size(); ++k) { m.check_step(steps[k], m.steps_done_ + m.plan_.planned_steps() + k); }
    if (m.reducer_) {
      m.plan_together(steps);
    } else {
      for (const step_plan& s : steps) { m.plan_.append(s); }
    }
    m.planned_steps_ += steps.size();
    m.start();
    m.prefetch();
  });
}

unit_view runtime::acquire(unit_id u, stream_view s)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    unit_record& r = m.record(u);
    TASKSWAP_EXPECTS(!r.held, message("acquire('", r.name, "'): the unit is already held; release it first"));
    m.check_comm();
    m.start();
    m.begin_step();
    m.acquire(r, s);
    const detail::unit_layout& l = r.layout;
    unit_view v;
    v.id = u;
    v.tensors = l.tensors;
    v.params = {r.slot->data() + l.params, l.compute, l.count};
    v.grads = {r.slot->data() + l.device_grads, l.grad, l.count};
    return v;
  });
}

void runtime::impl::acquire(unit_record& r, stream_view s)
{
  const unit_id u{r.index};
  r.stepped = false;
  const std::optional<std::uint64_t> position = plan_.match(u);
  if (!position) {
    TASKSWAP_EXPECTS(!reducer_, message("acquire('", r.name, "'): step ", steps_done_,
                                        " did not plan it. With a communicator every acquisition must be planned "
                                        "(runtime::plan), since the ranks agree on each step's units when it is planned"));
    ++current_.unplanned;
  }
  if (r.resident()) {
    ++current_.hits;
  } else {
    ++current_.misses;
    if (!swap_in(r, position.value_or(0), true)) {
      const std::size_t budget = options_.device.budget;
      const std::size_t free = budget - pool_->stats().used;
      throw out_of_memory(
        message("acquire('", r.name, "') needs ", bytes_text(r.layout.device_bytes), " of device memory; ",
                held_count_, " units held now use ", bytes_text(held_bytes_), " and the pinned units ",
                bytes_text(pinned_bytes_), " of the ", bytes_text(budget), " budget (",
                free >= r.layout.device_bytes ? "enough in total, but no free block is large enough"
                                              : "not enough left",
                "); release units earlier or plan the step so the runtime checks it ahead"),
        r.layout.device_bytes, free, budget);
    }
  }
  r.held = true;
  ++held_count_;
  if (!r.pinned()) { held_bytes_ += r.layout.device_bytes; }
  if (reducer_) { step_units_.push_back(r.index); }
  // The previous use ended on another stream (the trainer's, or aux after an update): wait for it.
  if (r.released_on != nullptr && r.released_on != s.native_handle()) {
    if (!r.released.query()) { r.released.wait(s); }
    r.released_on = nullptr;
  }
  const bool pending = !r.arrived.query();  // a finished swap-in needs no wait enqueued
  if (pending && options_.measure_stall) {
    if (stalls_free_.empty()) {
      stalls_free_.push_back({event(device_, {.timing = true}), event(device_, {.timing = true}), 0});
    }
    stall_timer t = std::move(stalls_free_.back());
    stalls_free_.pop_back();
    t.step = steps_done_;
    t.begin.record(s);
    r.arrived.wait(s);
    t.end.record(s);
    stalls_pending_.push_back(std::move(t));
  } else if (pending) {
    r.arrived.wait(s);
  }
  if (trace_) { r.trace_span = trace_->open(compute_track(s), r.name, s); }
  prefetch();
}

void runtime::grads_ready(unit_id u, stream_view s)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    m.check_comm();
    unit_record& r = m.held_record(u, "grads_ready");
    if (m.reducer_) {
      m.mark_ready(r, s);
      return;
    }
    ensure(r.grads_ready_event, m.device_).record(s);
  });
}

void runtime::step(unit_id u, stream_view s)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    m.check_comm();
    unit_record& r = m.held_record(u, "step");
    if (!m.reducer_) {
      if (r.grads_ready_event && r.grads_ready_event->recorded()) { r.grads_ready_event->wait(s); }
      m.apply_step(r, s);
      r.stepped = true;
      return;
    }
    TASKSWAP_EXPECTS(!r.step_requested, message("step('", r.name, "'): the unit was stepped already in this step"));
    m.mark_ready(r, s);  // a step implies the gradients are complete
    r.step_requested = true;
    if (const event* reduced = m.reducer_->reduced(r.index)) {
      if (!reduced->query()) { reduced->wait(s); }
      m.apply_step(r, s);
      return;
    }
    // Its bucket waits for units not ready yet: the update runs on aux once it is launched.
    ensure(r.step_point, m.device_).record(s);
    r.step_deferred = true;
  });
}

void runtime::impl::apply_step(unit_record& r, stream_view s)
{
  const detail::unit_layout& l = r.layout;
  ++r.step;
  // With a communicator every update of a step uses the settings the step began with, whichever
  // rank's call order enqueues it: replicas stay identical when set_optimizer changes them.
  const detail::adamw_scalars scalars =
    detail::make_adamw_scalars(reducer_ && step_begun_ ? step_optimizer_ : options_.optimizer, r.step);
  if (r.policy.optimizer == optimizer_placement::device) {
    detail::adamw_async(l.slabs_at(r.slot->data(), l.device_grads), scalars, s);
    fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, s);
    r.dirty = true;
    return;
  }
  // Host placement: gradients home on d2h (after the previous CPU step let go of them), then the
  // CPU AdamW on host_opt; the device parameters are stale until uploaded again.
  ensure(r.grads_done, device_).record(s);
  r.grads_done->wait(d2h_);
  if (r.host_updated && r.host_updated->recorded()) { r.host_updated->wait(d2h_); }
  const std::size_t grad_bytes = l.device_grad_bytes();
  const std::size_t span = trace_ ? trace_->open(d2h_track_, "grads " + r.name, d2h_) : 0;
  copy_async(std::span<std::byte>(r.home + l.home_grads, grad_bytes),
             const_device_span(r.slot->subspan(r.grads_at(), grad_bytes)), d2h_);
  fill_async(r.slot->subspan(r.grads_at(), grad_bytes), std::byte{0}, d2h_);
  ensure(r.grads_copied, device_).record(d2h_);
  if (trace_) { trace_->close(span, d2h_); }
  current_.d2h_bytes += grad_bytes;
  r.grads_copied->wait(host_opt_);
  const detail::adamw_slabs slabs = l.slabs_at(r.home, l.home_grads);
  detail::host_task_arena* cpu = &*cpu_;
  detail::trace_recorder* trace = trace_ ? &*trace_ : nullptr;
  launch_host_func(host_opt_, [slabs, scalars, cpu, trace, track = host_track_, name = r.name] {
    const auto begin = detail::trace_recorder::clock::now();
    detail::cpu_adamw_step(slabs, scalars, *cpu);
    if (trace != nullptr) { trace->host_span(track, "adamw " + name, begin, detail::trace_recorder::clock::now()); }
  });
  ensure(r.host_updated, device_).record(host_opt_);
  r.params_stale = true;
  r.stepped_here = true;
}

void runtime::release(unit_id u, stream_view s)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    m.check_comm();
    unit_record& r = m.held_record(u, "release");
    if (!m.reducer_) {
      if (!r.stepped) {  // given up without a step: its gradients are zero again for the next use
        const detail::unit_layout& l = r.layout;
        fill_async(r.slot->subspan(l.device_grads, l.device_grad_bytes()), std::byte{0}, s);
      }
      m.release(r, s);
      return;
    }
    TASKSWAP_EXPECTS(!r.release_deferred, message("release('", r.name, "'): the unit was released already"));
    if (!r.step_requested) {
      detail::log_once("release without step", log_level::warning,
                       message("release('", r.name, "'): the unit was not stepped; with a communicator the runtime "
                               "steps it so that every rank applies the same update. Call step() before release()"));
      step(u, s);
    }
    if (r.step_deferred) {  // the update has not run yet; the release follows it
      ensure(r.trainer_released, m.device_).record(s);
      r.release_deferred = true;
      --m.held_count_;  // the trainer no longer holds it; the runtime does until the update ran
      if (!r.pinned()) { m.held_bytes_ -= r.layout.device_bytes; }
      return;
    }
    if (r.updated_on_aux) {
      ensure(r.trainer_released, m.device_).record(s);
      r.trainer_released->wait(*m.aux_);
      m.release(r, *m.aux_);
      return;
    }
    m.release(r, s);
  });
}

void runtime::impl::release(unit_record& r, stream_view s)
{
  const unit_id u{r.index};
  r.released.record(s);
  r.released_on = s.native_handle();
  if (trace_) { trace_->close(r.trace_span, s); }
  r.held = false;
  if (!r.release_deferred) {  // a deferred release left the trainer's count when the trainer called it
    --held_count_;
    if (!r.pinned()) { held_bytes_ -= r.layout.device_bytes; }
  }
  r.release_deferred = false;
  r.last_release = ++tick_;
  if (r.params_stale) {
    // Upload the new parameters if the unit stays or is needed soon; otherwise free its room.
    const std::uint64_t next = plan_.next_use(u);
    const bool soon = next != detail::never &&
                      plan_.step_distance(next) <= static_cast<std::size_t>(std::max(r.policy.lookahead, 0));
    if (!r.grads_only && (r.pinned() || soon)) {
      upload_params(r);
    } else {
      evict(r);
    }
  }
  prefetch();
}

step_stats runtime::end_step()
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    m.check_comm();
    if (m.reducer_) {
      m.begin_step();  // a rank that trained nothing in the step still takes its updates
      if (m.step_begun_) { m.complete_step(); }
    }
    if (m.held_count_ != 0) {
      for (const unit_record& r : m.units_) {
        TASKSWAP_EXPECTS(!r.held || r.release_deferred || r.update_only,
                         message("end_step: unit '", r.name, "' is still held; release it before the step ends"));
      }
    }
    if (m.reducer_ && m.step_begun_) {
      m.reducer_->end();
      m.current_.reduced_bytes = m.reducer_->step_bytes();
      m.current_.reduce_all_bytes = m.reducer_->all_bytes();
      m.agreed_.pop_front();
      m.step_begun_ = false;
      for (const std::uint32_t u : m.step_units_) { m.reset_step_flags(m.units_[u]); }
      m.step_units_.clear();
    }
    m.plan_.end_step();
    m.resolve_stalls(false);
    m.current_.step = m.steps_done_;
    step_stats done = m.current_;
    step_stats& t = m.total_;
    t.h2d_bytes += done.h2d_bytes;
    t.d2h_bytes += done.d2h_bytes;
    t.hits += done.hits;
    t.misses += done.misses;
    t.unplanned += done.unplanned;
    t.swap_ins += done.swap_ins;
    t.write_backs += done.write_backs;
    t.evictions += done.evictions;
    t.stall_ms += done.stall_ms;
    t.peak_device_bytes = std::max(t.peak_device_bytes, done.peak_device_bytes);
    t.reduced_bytes += done.reduced_bytes;
    t.reduce_all_bytes += done.reduce_all_bytes;
    m.history_.push_back(done);
    if (m.history_.size() > stats_history) { m.history_.pop_front(); }
    ++m.steps_done_;
    m.current_ = step_stats{};
    m.current_.peak_device_bytes = m.pool_->stats().used;
    m.prefetch();
    return done;
  });
}

void runtime::flush()
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    // Units the runtime holds for the next step's updates (with a communicator) are no obstacle.
    for (const unit_record& r : m.units_) {
      TASKSWAP_EXPECTS(!r.held || r.update_only,
                       message("flush: unit '", r.name, "' is held; release it first"));
    }
    m.start();
    for (unit_record& r : m.units_) {
      if (r.resident() && r.dirty) { m.write_back(r); }
    }
    m.wait_streams("flush");
    m.resolve_stalls(true);
    m.check_comm();
  });
}

void runtime::impl::wait_streams(std::string_view what)
{
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  const std::array<std::pair<stream*, const char*>, 4> streams{{{aux_ ? &*aux_ : nullptr, "aux (updates)"},
                                                                {&h2d_, "h2d (swap-in)"},
                                                                {&d2h_, "d2h (write-back)"},
                                                                {&host_opt_, "host optimizer"}}};
  std::exception_ptr first;  // every stream is waited for; the first failure is thrown at the end
  for (const auto& [s, name] : streams) {
    if (s == nullptr) { continue; }
    try {
      event done(device_);
      done.record(*s);
      const auto left = std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero());
      if (!done.synchronize_for(left)) {
        const timeout_error e(message(what, ": the runtime's ", name, " stream has not finished within ",
                                      options_.timeout.count(),
                                      " ms ([runtime] timeout): a copy, or the trainer's work it waits for, is stalled. "
                                      "The runtime writes nothing more home; the home copies hold the states last "
                                      "written back"));
        device_.backend().abandon_work(std::make_exception_ptr(e));  // the emulated device drops what is queued
        throw e;
      }
      try {
        s->synchronize();  // done: returns at once, rethrowing a host function's error
      } catch (const error&) {
        throw;
      } catch (const std::exception& e) {  // a host function (the CPU AdamW) failed: the update is incomplete
        throw device_error(message(what, ": work on the runtime's ", name, " stream failed: ", e.what()));
      }
    } catch (...) {
      if (!first) { first = std::current_exception(); }
    }
  }
  if (first) { std::rethrow_exception(first); }
}

// ---- checkpoints -----------------------------------------------------------------------------

std::vector<detail::checkpoint_source> runtime::impl::checkpoint_sources()
{
  std::vector<detail::checkpoint_source> out;
  for (unit_record& r : units_) {
    const detail::unit_layout& l = r.layout;
    const std::size_t f32_bytes = l.v - l.m;
    detail::checkpoint_source c;
    c.name = r.name;
    c.compute = l.compute;
    c.tensors = l.tensors;
    c.step = r.step;
    c.params = {r.home + l.params, (l.compute == dtype::f32 ? l.m : l.master) - l.params};
    if (l.compute != dtype::f32) { c.master = {r.home + l.master, f32_bytes}; }
    c.m = {r.home + l.m, f32_bytes};
    c.v = {r.home + l.v, f32_bytes};
    out.push_back(std::move(c));
  }
  return out;
}

void runtime::save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    if (!m.reducer_) {
      flush();  // the home copies current; refuses held units
      const std::vector<detail::checkpoint_source> sources = m.checkpoint_sources();
      detail::write_checkpoint(dir, m.describe(sources, user), sources);
      return;
    }
    // Every rank holds a replica. Each rank puts a digest of its position and checksums (or -1
    // when it could not get that far) in its own slot; rank 0 writes only when all slots agree,
    // and a second collective tells every rank how that went. No rank throws between the two.
    detail::reducer& red = *m.reducer_;
    const auto world = static_cast<std::size_t>(red.world());
    const auto rank = static_cast<std::size_t>(red.rank());
    std::string failure;
    checkpoint_manifest manifest;
    std::vector<detail::checkpoint_source> sources;
    std::vector<std::int64_t> digests(world, 0);
    try {
      flush();
      sources = m.checkpoint_sources();
      manifest = m.describe(sources, user);
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
  });
}

checkpoint_manifest runtime::impl::describe(std::span<const detail::checkpoint_source> sources,
                                            const std::map<std::string, std::string>& user)
{
  checkpoint_manifest manifest = detail::describe_checkpoint(sources);
  manifest.steps_done = steps_done_;
  manifest.optimizer = options_.optimizer;
  manifest.user = user;
  return manifest;
}

checkpoint_manifest runtime::load_checkpoint(const std::filesystem::path& dir)
{
  impl& m = *impl_;
  if (m.failed_ && !m.load_failed_) { std::rethrow_exception(m.failed_); }  // after a failed load: load again
  TASKSWAP_EXPECTS(!m.started_, message("load_checkpoint('", dir.string(),
                                        "'): call it before the first plan, acquire or flush, as initial values are written"));
  const std::vector<detail::checkpoint_source> sources = m.checkpoint_sources();
  // With a communicator: every rank loads, or none does; each learns which ranks could not.
  const auto agree = [&](const std::string& failure, std::string_view stage) {
    if (!m.reducer_) {
      if (!failure.empty()) { throw checkpoint_error(failure); }
      return;
    }
    detail::reducer& red = *m.reducer_;
    std::vector<std::int64_t> failed(static_cast<std::size_t>(red.world()), 0);
    failed[static_cast<std::size_t>(red.rank())] = failure.empty() ? 0 : 1;
    red.sum(failed, message("checkpoint '", dir.string(), "': the ranks' ", stage));
    if (!failure.empty()) { throw checkpoint_error(failure); }
    std::string ranks;
    for (std::size_t r = 0; r < failed.size(); ++r) {
      if (failed[r] != 0) { ranks += (ranks.empty() ? "" : ", ") + std::to_string(r); }
    }
    if (!ranks.empty()) {
      throw checkpoint_error(message("rank(s) ", ranks, " could not load the checkpoint '", dir.string(),
                                     "' (", stage, "); their errors say why"));
    }
  };
  checkpoint_manifest manifest;
  std::vector<std::size_t> where;
  std::string failure;
  try {
    manifest = read_checkpoint_manifest(dir);
    detail::verify_data(dir, manifest);
    where = detail::match_units(dir, manifest, sources);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  agree(failure, "checks; nothing was loaded");
  try {
    detail::read_checkpoint(dir, manifest, sources, where);
  } catch (const std::exception& e) {
    // The home copies are partly overwritten: nothing may train on them.
    failure = message(e.what(), " (load again before training: this runtime refuses every call until then)");
  }
  if (!failure.empty()) {
    m.failed_ = std::make_exception_ptr(checkpoint_error(failure));
    m.load_failed_ = true;
  }
  agree(failure, "reads");
  m.failed_ = nullptr;
  m.load_failed_ = false;
  for (std::size_t i = 0; i < m.units_.size(); ++i) { m.units_[i].step = manifest.units[where[i]].step; }
  m.steps_done_ = manifest.steps_done;
  m.planned_steps_ = manifest.steps_done;
  m.current_.step = manifest.steps_done;
  m.options_.optimizer = manifest.optimizer;
  return manifest;
}

void runtime::set_optimizer(const adamw_options& options) { impl_->options_.optimizer = options; }

runtime_stats runtime::stats() const
{
  impl& m = *impl_;
  m.resolve_stalls(false);
  runtime_stats s;
  s.total = m.total_;
  s.steps.assign(m.history_.begin(), m.history_.end());
  const detail::device_pool_stats pool = m.pool_->stats();
  s.budget = pool.budget;
  s.pinned_device_bytes = m.pinned_bytes_;
  s.device_bytes_in_use = pool.used;
  s.pool_fragmentation = pool.fragmentation();
  const pinned_arena_stats arena = m.arena_->stats();
  s.home_bytes = arena.used;
  s.host_bytes_pinned = arena.pinned;
  s.units.reserve(m.units_.size());
  for (const unit_record& r : m.units_) {
    s.units.push_back(unit_stats{r.name, state_of(r), r.dirty, r.layout.device_bytes, r.layout.home_bytes, r.swap_ins, r.write_backs, r.step,
                                 r.policy});
  }
  return s;
}

void runtime::write_trace(const std::filesystem::path& file)
{
  return impl_->guarded([&] {
    impl& m = *impl_;
    TASKSWAP_EXPECTS(m.trace_.has_value(), "write_trace: the trace is off; set trace = true in the runtime options");
    m.wait_streams("write_trace");
    m.trace_->write(file);
  });
}

const device& runtime::get_device() const noexcept { return impl_->device_; }

}  // namespace taskswap
