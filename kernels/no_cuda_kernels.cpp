// SPDX-License-Identifier: Apache-2.0
// Built when TASKSWAP_CUDA is off: no CUDA device can exist, so no launcher can be reached; each
// says so if it ever is.
#include "kernels/cuda_kernels.hpp"

#include <taskswap/error.hpp>

namespace taskswap::detail {

namespace {
[[noreturn]] void no_cuda() { throw cuda_error("taskswap was built without CUDA (TASKSWAP_CUDA=OFF)"); }
}  // namespace

void launch_adamw(const adamw_slabs&, const adamw_scalars&, int, void*) { no_cuda(); }
void launch_adamw_guarded(const adamw_slabs&, const adamw_scalars*, const step_guard*, int, void*) { no_cuda(); }
void launch_square_sum(const void*, dtype, std::size_t, step_guard*, double*, int, void*) { no_cuda(); }
void launch_finish_guard(step_guard*, const guard_settings&, int, void*) { no_cuda(); }
void launch_prepare_guarded(const adamw_options&, const adamw_options&, std::int64_t*, const step_guard*,
                            adamw_scalars*, int, void*)
{
  no_cuda();
}
void launch_unscale_and_check(void*, dtype, std::size_t, float, int*, int, void*) { no_cuda(); }
void launch_cast(void*, dtype, const void*, dtype, std::size_t, int, void*) { no_cuda(); }
void launch_fill(void*, dtype, std::size_t, float, int, void*) { no_cuda(); }

}  // namespace taskswap::detail
