// SPDX-License-Identifier: Apache-2.0
#pragma once

// The element-wise operations on flat slabs that the runtime runs on a unit's device, one API for
// both backends: on cuda they are CUDA kernels (cuda_kernels.cu), on emulated they run the CPU
// implementations on the stream's worker thread. Results are bitwise the same on both (the AdamW
// formula and the conversions are shared: host/adamw_formula.hpp). Each call is enqueued on the
// given stream and does not synchronise; pointers are device memory of the stream's device,
// 4-byte aligned (2-byte for 16-bit slabs), of any length.

#include "host/adamw_formula.hpp"
#include "host/adamw_slabs.hpp"
#include "host/step_guard.hpp"

#include <taskswap/device.hpp>
#include <taskswap/dtype.hpp>

#include <cstddef>

namespace taskswap::detail {

/// AdamW over a unit's slabs (see adamw_formula.hpp).
void adamw_async(const adamw_slabs& slabs, const adamw_scalars& scalars, stream_view s);

/// AdamW of a guarded step (step_guard.hpp): nothing when guard->skip is set; else the scalars
/// at `scalars` (device memory, written by prepare_guarded_async before it on the stream).
void adamw_async(const adamw_slabs& slabs, const adamw_scalars* scalars, const step_guard* guard, stream_view s);

/// Adds the square sum of `count` gradients, unscaled by 1 / guard->scale, to guard->square_sum
/// in the fixed order of step_guard.hpp. `lanes`: device scratch of square_sum_blocks doubles
/// (unused on the emulated device, whose worker sums on the CPU).
void square_sum_async(const void* grad, dtype type, std::size_t count, step_guard* guard, double* lanes, stream_view s);

/// finish_step_guard on the device, one thread.
void finish_guard_async(step_guard* guard, const guard_settings& settings, stream_view s);

/// prepare_guarded_scalars on the device, one thread: `step` and `out` (two scalars) in device memory.
void prepare_guarded_async(const adamw_options& decay, const adamw_options& plain, std::int64_t* step,
                           const step_guard* guard, adamw_scalars* out, stream_view s);

/// g = g * factor in place, in the gradient's dtype (widen, multiply, round to nearest even);
/// sets *found_nonfinite (an int in device memory, which the caller zeroes) to 1 if any result is
/// not finite. The flag is only ever set, never cleared.
void unscale_and_check_async(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite,
                             stream_view s);

/// dst = src converted element by element (exact widening, round-to-nearest-even narrowing).
void cast_async(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count, stream_view s);

/// Every element of dst = value rounded to dst_type.
void fill_async(void* dst, dtype type, std::size_t count, float value, stream_view s);

// The CPU implementations, also the references of the tests.
/// The square sum in the kernels' order, added to g.square_sum.
void host_square_sum(const void* grad, dtype type, std::size_t count, step_guard& g);
void host_unscale_and_check(void* grad, dtype type, std::size_t count, float factor, int* found_nonfinite);
void host_cast(void* dst, dtype dst_type, const void* src, dtype src_type, std::size_t count);
void host_fill(void* dst, dtype type, std::size_t count, float value);

}  // namespace taskswap::detail
