// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The one header a user includes.

#include <taskswap/build_info.hpp>
#include <taskswap/checkpoint.hpp>
#include <taskswap/comm.hpp>
#include <taskswap/config.hpp>
#include <taskswap/cpu_adamw.hpp>
#include <taskswap/device.hpp>
#include <taskswap/dtype.hpp>
#include <taskswap/error.hpp>
#include <taskswap/host.hpp>
#include <taskswap/log.hpp>
#include <taskswap/optimizer.hpp>
#include <taskswap/runtime.hpp>
#include <taskswap/stop.hpp>
