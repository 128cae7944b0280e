// SPDX-License-Identifier: Apache-2.0
#include "runtime_properties.hpp"

namespace taskswap::test {

// The device's memory is exactly the budget: nothing but the runtime's pool fits on it.
template <std::size_t Granule>
struct emulated_runtime_backend {
  static std::string skip_reason() { return {}; }
  static std::size_t granule() { return Granule; }
  static device make(std::size_t budget)
  {
    return emulated_device({.memory_bytes = budget, .link = {}, .granularity = Granule});
  }
};

// 256 bytes: granules counted, each slot its own memory (the emulated default). 4 KiB: a memory
// file mapped into the slots, so slots alias granules as on CUDA and a granule reused too early
// would show in the results.
using emulated_types = ::testing::Types<emulated_runtime_backend<256>, emulated_runtime_backend<4096>>;
INSTANTIATE_TYPED_TEST_SUITE_P(emulated, runtime_properties, emulated_types);

}  // namespace taskswap::test
