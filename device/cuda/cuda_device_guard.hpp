// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "device/cuda/cuda_try.hpp"

namespace taskswap::detail {

/// Makes `index` the calling thread's current CUDA device and restores the previous one.
class cuda_device_guard {
 public:
  explicit cuda_device_guard(int index)
  {
    TASKSWAP_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != index) { TASKSWAP_CUDA_TRY(cudaSetDevice(index)); }
    switched_ = previous_ != index;
  }
  ~cuda_device_guard()
  {
    if (switched_) { TASKSWAP_ASSERT_CUDA_SUCCESS(cudaSetDevice(previous_)); }
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;
  cuda_device_guard(cuda_device_guard&&) = delete;
  cuda_device_guard& operator=(cuda_device_guard&&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace taskswap::detail
