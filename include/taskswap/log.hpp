// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Where taskswap's warnings and notes go (standard error unless a handler is set).

#include <functional>
#include <string_view>

namespace taskswap {

/// @brief How much a message matters.
enum class log_level { info, warning };

/// @brief Receives every message; called from whichever thread logs, so it must be thread-safe.
using log_handler = std::function<void(log_level, std::string_view)>;

/// @brief Sends messages to `handler`; an empty handler restores the default (standard error).
/// @return the handler that was installed before
log_handler set_log_handler(log_handler handler);

}  // namespace taskswap
