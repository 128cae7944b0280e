// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <taskswap/log.hpp>

#include <string>
#include <string_view>

namespace taskswap::detail {

/// Sends one message to the installed handler.
void log(log_level level, std::string_view text);

/// Sends the message the first time `key` is seen in this process, and never again.
void log_once(std::string_view key, log_level level, std::string_view text);

}  // namespace taskswap::detail
