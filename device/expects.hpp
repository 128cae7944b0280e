// SPDX-License-Identifier: Apache-2.0
#pragma once

// Precondition checks that throw taskswap::invalid_argument with the location and a message.

#include "device/message.hpp"

#include <taskswap/error.hpp>

#define TASKSWAP_STRINGIFY_DETAIL(x) #x
#define TASKSWAP_STRINGIFY(x) TASKSWAP_STRINGIFY_DETAIL(x)

/// Throws taskswap::invalid_argument(msg) when `cond` is false. `msg` is evaluated only then.
#define TASKSWAP_EXPECTS(cond, msg)                                                                          \
  do {                                                                                                       \
    if (!(cond)) [[unlikely]] {                                                                              \
      throw ::taskswap::invalid_argument(                                                                    \
        ::taskswap::detail::message("taskswap: ", msg, " [" __FILE__ ":" TASKSWAP_STRINGIFY(__LINE__) "]")); \
    }                                                                                                        \
  } while (false)
