// SPDX-License-Identifier: Apache-2.0
#include "cuda_skip.hpp"
#include "device_conformance.hpp"

namespace taskswap::test {

struct cuda_backend_under_test {
  static std::string skip_reason() { return cuda_skip_reason(); }
  static device make() { return cuda_device(0); }
};

using cuda_types = ::testing::Types<cuda_backend_under_test>;
INSTANTIATE_TYPED_TEST_SUITE_P(cuda, device_conformance, cuda_types);

}  // namespace taskswap::test
