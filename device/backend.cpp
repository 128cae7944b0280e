// SPDX-License-Identifier: Apache-2.0
#include "device/backend.hpp"

#include <cstdio>
#include <exception>
#include <utility>

namespace taskswap::detail {

void host_func_errors::keep(std::exception_ptr error) noexcept
{
  const std::lock_guard lock(mutex_);
  if (!first_) { first_ = std::move(error); }  // the first one wins
}

void host_func_errors::rethrow()
{
  std::exception_ptr error;
  {
    const std::lock_guard lock(mutex_);
    error = std::exchange(first_, nullptr);
  }
  if (error) { std::rethrow_exception(error); }
}

void backend::open_error_slot(void* s)
{
  auto slot = std::make_shared<host_func_errors>();
  const std::lock_guard lock(error_slots_mutex_);
  error_slots_[s] = std::move(slot);
}

void backend::close_error_slot(void* s) noexcept
{
  const std::lock_guard lock(error_slots_mutex_);
  error_slots_.erase(s);
}

std::shared_ptr<host_func_errors> backend::error_slot(void* s)
{
  const std::lock_guard lock(error_slots_mutex_);
  auto& slot = error_slots_[s];
  if (!slot) { slot = std::make_shared<host_func_errors>(); }  // a handle made outside stream
  return slot;
}

void run_host_func(host_func_errors& slot, const std::function<void()>& fn) noexcept
{
  try {
    fn();
  } catch (...) {
    slot.keep(std::current_exception());
  }
}

}  // namespace taskswap::detail
