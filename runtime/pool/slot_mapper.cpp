// SPDX-License-Identifier: Apache-2.0
#include "runtime/pool/slot_mapper.hpp"

#include "device/backend.hpp"
#include "device/message.hpp"

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
  for (const auto& [address, granules] : mapped_) {
    try {
      b.vm_unmap(address, granules);
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

void slot_mapper::run()
{
#if defined(__linux__)
  static_cast<void>(pthread_setname_np(pthread_self(), "taskswap-map"));
#endif
  std::unique_lock lock(mutex_);
  for (;;) {
    queued_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) { return; }  // stopping, and nothing left to do
    job j = std::move(jobs_.front());
    jobs_.pop_front();
    const bool skip = failure_ != nullptr;  // after a failure nothing more is mapped
    lock.unlock();
    std::exception_ptr failed;
    if (!skip) {
      try {
        carry_out(j);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    j = job{};  // its fence event is destroyed here, outside the lock
    lock.lock();
    if (failed && !failure_) { failure_ = failed; }
    ++done_;
    finished_.notify_all();
  }
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
        mapped_.emplace(c.address, c.granules);
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
