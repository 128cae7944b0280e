// SPDX-License-Identifier: Apache-2.0
#pragma once

// The cuda backend. This header is free of CUDA types so that the public layer compiles the
// same with and without CUDA; without it, cuda_device_count() is 0 and cuda_backend_for throws.

#include "device/backend.hpp"

#include <memory>

namespace taskswap::detail {

/// CUDA devices usable by this process; 0 without CUDA, a driver or a device. Never throws.
[[nodiscard]] int cuda_device_count() noexcept;

/// The one backend object for CUDA ordinal `index` (shared while any device refers to it).
/// @throws cuda_error if CUDA is not built in or the ordinal does not exist
[[nodiscard]] std::shared_ptr<backend> cuda_backend_for(int index);

}  // namespace taskswap::detail

namespace taskswap::detail {

/// "13.0" for the CUDA runtime linked in, or empty without CUDA.
[[nodiscard]] std::string cuda_runtime_version();
/// "13.0" for the installed driver's CUDA version, "none" without a driver, empty without CUDA.
[[nodiscard]] std::string cuda_driver_version();

}  // namespace taskswap::detail
