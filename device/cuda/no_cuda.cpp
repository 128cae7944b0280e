// SPDX-License-Identifier: Apache-2.0
// Built when TASKSWAP_CUDA is off: the cuda backend reports no devices.

#include "device/cuda/cuda_backend.hpp"
#include "device/message.hpp"

namespace taskswap::detail {

int cuda_device_count() noexcept { return 0; }

std::shared_ptr<backend> cuda_backend_for(int index)
{
  throw cuda_error(message("cuda device ", index,
                           " requested, but taskswap was built without CUDA (TASKSWAP_CUDA=OFF); "
                           "rebuild with the CUDA toolkit or use the emulated backend"));
}

}  // namespace taskswap::detail

namespace taskswap::detail {

std::string cuda_runtime_version() { return {}; }
std::string cuda_driver_version() { return {}; }

}  // namespace taskswap::detail
