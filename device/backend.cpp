// SPDX-License-Identifier: Apache-2.0
#include "device/backend.hpp"

#include <cstdio>
#include <exception>

namespace taskswap::detail {

void backend::keep_host_func_error(void* s, std::exception_ptr error) noexcept
{
  const std::lock_guard lock(host_func_errors_mutex_);
  host_func_errors_.try_emplace(s, std::move(error));  // the first one wins
}

void backend::rethrow_host_func_error(void* s)
{
  std::exception_ptr error;
  {
    const std::lock_guard lock(host_func_errors_mutex_);
    auto found = host_func_errors_.find(s);
    if (found == host_func_errors_.end()) { return; }
    error = std::move(found->second);
    host_func_errors_.erase(found);
  }
  std::rethrow_exception(error);
}

void backend::forget_host_func_errors(void* s) noexcept
{
  const std::lock_guard lock(host_func_errors_mutex_);
  host_func_errors_.erase(s);
}

void run_host_func(backend& owner, void* s, const std::function<void()>& fn) noexcept
{
  try {
    fn();
  } catch (...) {
    owner.keep_host_func_error(s, std::current_exception());
  }
}

}  // namespace taskswap::detail
