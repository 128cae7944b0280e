// SPDX-License-Identifier: Apache-2.0
#include "device_conformance.hpp"

namespace taskswap::test {

struct emulated_backend_under_test {
  static std::string skip_reason() { return {}; }
  static device make() { return emulated_device({.memory_bytes = 1024 * MiB}); }
};

using emulated_types = ::testing::Types<emulated_backend_under_test>;
INSTANTIATE_TYPED_TEST_SUITE_P(emulated, device_conformance, emulated_types);

}  // namespace taskswap::test
