// SPDX-License-Identifier: Apache-2.0
#include "runtime/pool/slot_mapper.hpp"

#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"

#include <algorithm>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace taskswap::detail {

slot_mapper::slot_mapper(const device& dev, std::chrono::milliseconds timeout)
    : dev_(dev), timeout_(timeout), granule_(dev.backend().vm_granularity()), thread_([this] { run(); })
{}

slot_mapper::~slot_mapper() { static_cast<void>(stop()); }

slot_mapper::ticket slot_mapper::submit(job j)
{
  if (j.calls.empty()) { return 0; }
  ticket t = 0;
  {
    const std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(j));
    t = ++submitted_;
  }
  queued_.notify_one();
  return t;
}

void slot_mapper::defer(job j)
{
  if (j.calls.empty()) { return; }
  for (const call& c : j.calls) {
    TASKSWAP_EXPECTS(c.what == call::kind::unmap, "slot_mapper: a deferred job may only unmap");
  }
  {
    const std::lock_guard lock(mutex_);
    deferred_.push_back({submitted_, std::move(j)});
  }
  queued_.notify_one();
}

bool slot_mapper::ready(ticket t)
{
  const std::lock_guard lock(mutex_);
  if (failure_) { std::rethrow_exception(failure_); }
  return done_ >= t;
}

void slot_mapper::wait(ticket t)
{
  std::unique_lock lock(mutex_);
  finished_.wait(lock, [&] { return done_ >= t || failure_; });
  if (failure_) { std::rethrow_exception(failure_); }
}

std::exception_ptr slot_mapper::stop() noexcept
{
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_one();
  if (thread_.joinable()) { thread_.join(); }
  const std::lock_guard lock(mutex_);
  return failure_;
}

std::vector<std::string> slot_mapper::release_all() noexcept
{
  std::vector<std::string> problems;
  const auto keep = [&](const std::exception& e) noexcept {
    try {
      problems.emplace_back(e.what());
    } catch (...) {  // out of memory while tearing down: the report is shorter
    }
  };
  backend& b = dev_.backend();
  for (const auto& [address, mapping] : mapped_) {
    try {
      b.vm_unmap(address, mapping.first);
    } catch (const std::exception& e) {
      keep(e);
    }
  }
  mapped_.clear();
  for (std::size_t e = 0; e < handles_.size(); ++e) {
    if (handles_[e] == nullptr) { continue; }
    try {
      b.vm_release(handles_[e], handle_granules_[e]);
    } catch (const std::exception& f) {
      keep(f);
    }
    handles_[e] = nullptr;
  }
  return problems;
}

void slot_mapper::run_here(const job& j) { carry_out(j); }

namespace {

// How long the idle thread waits before it looks again at a deferred job's fence.
constexpr std::chrono::milliseconds fence_poll{1};

// Whether the job's fence has completed; a device that cannot say lets carry_out() fail the job.
bool fence_done(const std::optional<event>& fence) noexcept
{
  try {
    return !fence || fence->query();
  } catch (...) {
    return true;
  }
}

}  // namespace

void slot_mapper::run()
{
#if defined(__linux__)
  static_cast<void>(pthread_setname_np(pthread_self(), "taskswap-map"));
#endif
  std::unique_lock lock(mutex_);
  for (;;) {
    if (!stopping_ && run_deferred(lock)) { continue; }  // a due unmap first: it is short, and clears the way
    if (jobs_.empty()) {
      if (stopping_) { return; }  // what is still deferred is left to release_all()
      if (deferred_.empty()) {
        queued_.wait(lock, [&] { return stopping_ || !jobs_.empty() || !deferred_.empty(); });
      } else {
        queued_.wait_for(lock, fence_poll, [&] { return stopping_ || !jobs_.empty(); });
      }
      continue;
    }
    job j = std::move(jobs_.front());
    jobs_.pop_front();
    std::vector<job> first = needed_by(j, done_ + 1);
    carry_out_all(std::move(first), std::move(j), lock);
    ++done_;
    finished_.notify_all();
  }
}

bool slot_mapper::run_deferred(std::unique_lock<std::mutex>& lock)
{
  const auto ready = std::find_if(deferred_.begin(), deferred_.end(),
                                  [&](const deferred& d) { return d.after <= done_ && fence_done(d.j.fence); });
  if (ready == deferred_.end()) { return false; }
  job j = std::move(ready->j);
  deferred_.erase(ready);
  carry_out_all({}, std::move(j), lock);
  return true;
}

std::vector<slot_mapper::job> slot_mapper::needed_by(const job& j, ticket t)
{
  const auto bytes = [&](const call& c) {
    return c.what == call::kind::free_addresses ? c.granules : c.granules * granule_;
  };
  const auto overlap = [&](const call& a, const call& b) {
    return a.address < b.address + bytes(b) && b.address < a.address + bytes(a);
  };
  // Whether the unmap `u` takes a mapping of the handle `extent` (as the jobs before it left them).
  const auto unmaps = [&](const call& u, std::uint32_t extent) {
    for (auto m = mapped_.lower_bound(u.address); m != mapped_.end() && m->first < u.address + bytes(u); ++m) {
      if (m->second.second == extent) { return true; }
    }
    return false;
  };
  const auto needs = [&](const job& d) {
    return std::any_of(j.calls.begin(), j.calls.end(), [&](const call& c) {
      return std::any_of(d.calls.begin(), d.calls.end(), [&](const call& u) {
        switch (c.what) {
          case call::kind::create: return false;
          case call::kind::release: return unmaps(u, c.extent);
          default: return overlap(c, u);
        }
      });
    });
  };
  std::vector<job> first;
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    if (it->after < t && needs(it->j)) {
      first.push_back(std::move(it->j));
      it = deferred_.erase(it);
    } else {
      ++it;
    }
  }
  return first;
}

void slot_mapper::carry_out_all(std::vector<job> first, job j, std::unique_lock<std::mutex>& lock)
{
  const bool skip = failure_ != nullptr;  // after a failure nothing more is mapped
  lock.unlock();
  std::exception_ptr failed;
  if (!skip) {
    try {
      for (const job& d : first) { carry_out(d); }
      carry_out(j);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  first.clear();  // the fence events are destroyed here, outside the lock
  j = job{};
  lock.lock();
  if (failed && !failure_) { failure_ = failed; }
}

void slot_mapper::carry_out(const job& j)
{
  if (j.fence && !j.fence->synchronize_for(timeout_)) {
    throw timeout_error(message("moving device memory that ", j.fence_users,
                                " used: its earlier uses have not finished within ", timeout_.count(),
                                " ms ([runtime] timeout); the trainer's stream or a copy is stalled"));
  }
  backend& b = dev_.backend();
  for (const call& c : j.calls) {
    switch (c.what) {
      case call::kind::create:
        if (handles_.size() <= c.extent) {
          handles_.resize(c.extent + 1, nullptr);
          handle_granules_.resize(c.extent + 1, 0);
        }
        handles_[c.extent] = b.vm_create(c.granules);
        handle_granules_[c.extent] = c.granules;
        break;
      case call::kind::release:
        b.vm_release(handles_[c.extent], c.granules);
        handles_[c.extent] = nullptr;
        break;
      case call::kind::map:
        b.vm_map(c.address, handles_[c.extent], c.granules);
        mapped_.emplace(c.address, std::pair{c.granules, c.extent});
        break;
      case call::kind::unmap:
        b.vm_unmap(c.address, c.granules);
        mapped_.erase(mapped_.lower_bound(c.address), mapped_.lower_bound(c.address + c.granules * granule_));
        break;
      case call::kind::free_addresses: b.vm_free(c.address, c.granules); break;
    }
  }
}

}  // namespace taskswap::detail
