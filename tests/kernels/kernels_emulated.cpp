// SPDX-License-Identifier: Apache-2.0
#include "kernels_conformance.hpp"

namespace taskswap::test {

struct emulated_kernels {
  static constexpr bool large = false;  // 2^26 + 5 runs on the GPU instance
  static std::string skip_reason() { return {}; }
  static device make() { return emulated_device({.memory_bytes = std::size_t{256} << 20}); }
};

using emulated_types = ::testing::Types<emulated_kernels>;
INSTANTIATE_TYPED_TEST_SUITE_P(emulated, kernels_conformance, emulated_types);

}  // namespace taskswap::test
