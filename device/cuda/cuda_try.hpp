// SPDX-License-Identifier: Apache-2.0
#pragma once

// Checks for CUDA runtime calls: TASKSWAP_CUDA_TRY throws cuda_error with the call text,
// file:line, error name and string; TASKSWAP_ASSERT_CUDA_SUCCESS is for destructors and never
// throws (it tolerates cudaErrorCudartUnloading, reports anything else).

#include "device/expects.hpp"

#include <cuda_runtime_api.h>

namespace taskswap::detail {

/// Throws cuda_error for `status`; clears the runtime's last error first.
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line);

/// Reports a failure inside a destructor or other noexcept teardown: prints it, and in debug
/// builds asserts.
void report_cuda_error(cudaError_t status, const char* call, const char* file, int line) noexcept;

}  // namespace taskswap::detail

#define TASKSWAP_CUDA_TRY(call)                                                          \
  do {                                                                                   \
    const cudaError_t taskswap_status_ = (call);                                         \
    if (taskswap_status_ != cudaSuccess) [[unlikely]] {                                  \
      ::taskswap::detail::throw_cuda_error(taskswap_status_, #call, __FILE__, __LINE__); \
    }                                                                                    \
  } while (false)

#define TASKSWAP_ASSERT_CUDA_SUCCESS(call)                                                 \
  do {                                                                                     \
    const cudaError_t taskswap_status_ = (call);                                           \
    if (taskswap_status_ != cudaSuccess && taskswap_status_ != cudaErrorCudartUnloading) { \
      ::taskswap::detail::report_cuda_error(taskswap_status_, #call, __FILE__, __LINE__);  \
    }                                                                                      \
  } while (false)
