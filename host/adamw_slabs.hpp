// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <taskswap/dtype.hpp>

#include <cstddef>

namespace taskswap::detail {

/// The slabs of one AdamW update. Pointers 4-byte aligned (2 for 16-bit slabs); no overlap.
struct adamw_slabs {
  float* master = nullptr;  // fp32 parameters (the master copy)
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  dtype grad_type = dtype::f32;
  void* params = nullptr;  // compute-dtype copy to write, or nullptr (compute dtype f32)
  dtype param_type = dtype::bf16;  // bf16 or f16 when params is set
  std::size_t count = 0;
};

}  // namespace taskswap::detail
