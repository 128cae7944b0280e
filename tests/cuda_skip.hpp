// SPDX-License-Identifier: Apache-2.0
#pragma once

// Why a CUDA test cannot run here, or nothing when it can: the one reason every `gpu`-labelled
// test gives when it skips.

#include <taskswap/build_info.hpp>
#include <taskswap/device.hpp>

#include <string>

namespace taskswap::test {

inline std::string cuda_skip_reason()
{
  const build_info info = get_build_info();
  if (!info.cuda) { return "taskswap was built without CUDA (TASKSWAP_CUDA=OFF)"; }
  if (cuda_device_count() == 0) {
    return "no CUDA device visible (driver " + info.cuda_driver_version +
           "); run tools/gpu-check on a machine with a GPU";
  }
  return {};
}

}  // namespace taskswap::test
