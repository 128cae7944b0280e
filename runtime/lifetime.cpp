// SPDX-License-Identifier: Apache-2.0
// The runtime's construction (units, homes, pool, trace, reducer), waiting for its streams, teardown.

#include "runtime/runtime_impl.hpp"

#include "device/backend.hpp"
#include "device/log.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace taskswap {

using detail::message;

runtime::impl::impl(const device& dev, const runtime_options& options, const std::vector<unit_spec>& specs,
                    std::shared_ptr<communicator> comm)
    : device_(dev), options_(options), residency_(specs.size()), streams_(dev), ledger_(dev, specs.size())
{
  const char* check = std::getenv("TASKSWAP_CHECK_STATES");  // NOLINT(concurrency-mt-unsafe): read once, here
  units_.check_states(check != nullptr && std::string_view(check) == "1");
  detail::guarded_step::check_scaler(options);
  if (!comm) { comm = make_communicator(dev, options.comm); }
  if (comm && comm->size() > 1 && !options_.storage.path.empty()) {
    // Every rank keeps its own replica of the disk homes: rank r's unit files are under rank<r>/.
    options_.storage.path /= message("rank", comm->rank());
  }
  register_units(options, specs);
  memory_.pool.emplace(dev, options.device.budget - residency_.model->guard_bytes(), options.timeout);
  place_homes();
  if (options_.trace) {
    trace_.recorder.emplace(device_, streams_.h2d.view());
    trace_.h2d = trace_.recorder->track("h2d (swap-in)");
    trace_.d2h = trace_.recorder->track("d2h (write-back)");
    trace_.host = trace_.recorder->track("host optimizer");
  }
  if (guard_) { streams_.aux.emplace(dev); }  // where guarded steps are finished and their units updated
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
      // What the update depends on: the ranks must update each unit alike.
      for (const tensor_info& t : l.tensors) {
        digest = detail::fnv1a(digest, t.state ? "s" : t.no_weight_decay ? "n" : "d");
      }
      digest = detail::fnv1a(
        digest, message(std::hexfloat, r.policy.lr_scale, "/", r.policy.weight_decay ? *r.policy.weight_decay : -1.0));
      units.push_back({r.name, l.reduce_bytes(), l.grad, digest, l.state_tensor_bytes()});
    }
    if (!streams_.aux) { streams_.aux.emplace(dev); }
    reduced_.emplace(dev, std::move(comm), options.comm, std::move(units));
  }
  swap_.emplace(detail::swap_engine::parts{.dev = device_,
                                           .units = units_.records(),
                                           .plan = residency_.plan,
                                           .model = *residency_.model,
                                           .pool = *memory_.pool,
                                           .ledger = ledger_,
                                           .h2d = streams_.h2d,
                                           .fill_order = streams_.fill_order,
                                           .d2h = streams_.d2h,
                                           .trace = trace_.recorder ? &*trace_.recorder : nullptr,
                                           .h2d_track = trace_.h2d,
                                           .d2h_track = trace_.d2h,
                                           .path = path()});
}

runtime::impl::~impl()
{
  // Keep the home copies current (unless something failed: then nothing more is written home)
  // and let no copy outlive the memory it touches. Whatever goes wrong is reported in one line at
  // the end: after a failure the trainer has seen its text already, and every unit would repeat it.
  const bool failed = life_.failed || (reduced_ && reduced_->reduction().comm().failed());
  std::size_t dirty = 0;
  for (const unit_record& r : units_) { dirty += r.dirty() ? 1U : 0U; }
  // The failure the trainer has seen (the runtime's first, or the communicator's): not repeated.
  std::string seen;
  try {
    if (life_.failed) { std::rethrow_exception(life_.failed); }
    if (reduced_) { reduced_->reduction().comm().check(); }
  } catch (const std::exception& f) {
    seen = f.what();
  } catch (...) {}
  std::vector<std::string> problems;
  const auto note = [&](std::string_view text) noexcept {
    try {
      if (!seen.empty() && text.find(seen) != std::string_view::npos) { return; }
      if (std::find(problems.begin(), problems.end(), text) == problems.end()) { problems.emplace_back(text); }
    } catch (...) {  // out of memory while tearing down: the report is shorter
    }
  };
  try {
    if (units_.held() == 0 && life_.started && !failed) {
      for (unit_record& r : units_) {
        if (r.dirty()) { swap_->write_back(r); }
      }
      dirty = 0;
    }
  } catch (const std::exception& e) {
    note("writing dirty units back failed");
    note(e.what());
  }
  try {
    wait_streams("runtime teardown");
  } catch (const std::exception& e) {
    note(e.what());
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  std::size_t unreleased = 0;
  for (unit_record& r : units_) {
    try {
      const auto left =
        std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero());
      if (r.released.recorded() && !r.released.synchronize_for(left)) {
        note(message("unit '", r.name, "' was not released on the device within ", options_.timeout.count(),
                     " ms; the trainer's stream is stalled"));  // a throw here is caught below
        break;
      }
    } catch (const std::exception& e) {
      ++unreleased;
      note(e.what());
    }
  }
  // The pool waits for the device and unmaps: what it finds is reported here, once, with the rest
  // (a faulted device's error is the failure the trainer has seen).
  if (memory_.pool) {
    for (const std::string& p : memory_.pool->close()) { note(p); }
  }
  try {  // a destructor never throws: not even a log handler's exception or bad_alloc
    if (failed || !problems.empty()) {
      std::string text = "runtime teardown";
      if (failed) {
        text += message(" after a failure: ", dirty, " dirty unit(s) of ", units_.size(),
                        " were not written back; the home copies hold the states last written back");
      }
      if (unreleased > 0) { text += message("; the release of ", unreleased, " unit(s) could not be waited for"); }
      for (const std::string& p : problems) { text += "; " + p; }
      detail::log(log_level::warning, text);
    }
  } catch (...) {}
  // The device memory and the home arena are freed next, and queued work may still touch them:
  // freeing waits for the device (as cudaFree does), after a stall until the stalled work ends.
}

void runtime::impl::stalled(const std::string& why)
{
  const timeout_error e(why);
  device_.backend().abandon_work(std::make_exception_ptr(e));  // the emulated device drops what is queued
  throw e;
}

void runtime::impl::wait_streams(std::string_view what)
{
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  const std::array<std::pair<stream*, const char*>, 5> streams{
    {{streams_.aux ? &*streams_.aux : nullptr, "aux (updates)"},
     {&streams_.h2d, "h2d (swap-in)"},
     {&streams_.d2h, "d2h (write-back)"},
     {&streams_.host_opt, "host optimizer"},
     {&streams_.fill_order, "swap-in order"}}};
  std::exception_ptr first;  // every stream is waited for; the first failure is thrown at the end
  for (const auto& [s, name] : streams) {
    if (s == nullptr) { continue; }
    try {
      event done(device_);
      done.record(*s);
      const auto left =
        std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero());
      if (!done.synchronize_for(left)) {
        stalled(message(what, ": the runtime's ", name, " stream has not finished within ", options_.timeout.count(),
                        " ms ([runtime] timeout): a copy, or the trainer's work it waits for, is stalled. "
                        "The runtime writes nothing more home; the home copies hold the states last written back"));
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

void runtime::impl::write_trace(const std::filesystem::path& file)
{
  TASKSWAP_EXPECTS(trace_.recorder.has_value(),
                   "write_trace: the trace is off; set trace = true in the runtime options");
  wait_streams("write_trace");
  trace_.recorder->write(file);
}

}  // namespace taskswap
