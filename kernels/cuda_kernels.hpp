// SPDX-License-Identifier: Apache-2.0
#pragma once

// Launchers of the CUDA kernels (cuda_kernels.cu), free of CUDA types. Each launches on `stream`
// (a cudaStream_t) of CUDA device `device_index` and checks the launch.

#include "host/adamw_formula.hpp"
#include "host/adamw_slabs.hpp"

#include <taskswap/dtype.hpp>

#include <cstddef>

namespace taskswap::detail {

void launch_adamw(const adamw_slabs& slabs, const adamw_scalars& scalars, int device_index, void* stream);
void launch_unscale_and_check(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite,
                              int device_index, void* stream);
void launch_cast(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count,
                 int device_index, void* stream);
void launch_fill(void* dst, dtype type, std::size_t count, float value, int device_index, void* stream);

}  // namespace taskswap::detail
