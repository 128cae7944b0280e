// SPDX-License-Identifier: Apache-2.0
#pragma once

// Launchers of the CUDA kernels (cuda_kernels.cu), free of CUDA types. Each launches on `stream`
// (a cudaStream_t) of CUDA device `device_index` and checks the launch.

#include "host/adamw_formula.hpp"
#include "host/adamw_slabs.hpp"
#include "host/step_guard.hpp"

#include <taskswap/dtype.hpp>

#include <cstddef>

namespace taskswap::detail {

void launch_adamw(const adamw_slabs& slabs, const adamw_scalars& scalars, int device_index, void* stream);
void launch_adamw_guarded(const adamw_slabs& slabs, const adamw_scalars* scalars, const step_guard* guard,
                          int device_index, void* stream);
void launch_square_sum(const void* grad, dtype type, std::size_t count, step_guard* guard, double* lanes,
                       int device_index, void* stream);
void launch_finish_guard(step_guard* guard, const guard_settings& settings, int device_index, void* stream);
void launch_prepare_guarded(const adamw_options& decay, const adamw_options& plain, std::int64_t* step,
                            const step_guard* guard, adamw_scalars* out, int device_index, void* stream);
void launch_unscale_and_check(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite,
                              int device_index, void* stream);
void launch_cast(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count, int device_index,
                 void* stream);
void launch_fill(void* dst, dtype type, std::size_t count, float value, int device_index, void* stream);

}  // namespace taskswap::detail
