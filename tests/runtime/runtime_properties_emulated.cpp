// SPDX-License-Identifier: Apache-2.0
#include "runtime_properties.hpp"

namespace taskswap::test {

struct emulated_runtime_backend {
  static std::string skip_reason() { return {}; }
  // The device's memory is exactly the budget: nothing but the runtime's pool fits on it.
  static device make(std::size_t budget) { return emulated_device({.memory_bytes = budget, .link = {}}); }
};

using emulated_types = ::testing::Types<emulated_runtime_backend>;
INSTANTIATE_TYPED_TEST_SUITE_P(emulated, runtime_properties, emulated_types);

}  // namespace taskswap::test
