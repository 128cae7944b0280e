// SPDX-License-Identifier: Apache-2.0
#include "device/log.hpp"

#include <cstdio>
#include <mutex>
#include <set>
#include <utility>

namespace taskswap {

namespace {
std::mutex& log_mutex()
{
  static std::mutex mutex;
  return mutex;
}
log_handler& current_handler()
{
  static log_handler handler;
  return handler;
}
}  // namespace

log_handler set_log_handler(log_handler handler)
{
  const std::lock_guard lock(log_mutex());
  return std::exchange(current_handler(), std::move(handler));
}

namespace detail {

void log(log_level level, std::string_view text)
{
  log_handler handler;
  {
    const std::lock_guard lock(log_mutex());
    handler = current_handler();
  }
  if (handler) {
    handler(level, text);
    return;
  }
  std::fprintf(stderr, "taskswap %s: %.*s\n", level == log_level::warning ? "warning" : "info",
               static_cast<int>(text.size()), text.data());
}

void log_once(std::string_view key, log_level level, std::string_view text)
{
  static std::mutex mutex;
  static std::set<std::string, std::less<>> seen;
  {
    const std::lock_guard lock(mutex);
    if (!seen.emplace(key).second) { return; }
  }
  log(level, text);
}

}  // namespace detail
}  // namespace taskswap
