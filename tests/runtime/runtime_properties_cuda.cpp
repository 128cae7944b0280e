// SPDX-License-Identifier: Apache-2.0
#include "cuda_skip.hpp"
#include "runtime_properties.hpp"

namespace taskswap::test {

struct cuda_runtime_backend {
  static std::string skip_reason() { return cuda_skip_reason(); }
  static std::size_t granule() { return cuda_device(0).granularity(); }
  static device make(std::size_t /*budget*/) { return cuda_device(0); }
};

using cuda_types = ::testing::Types<cuda_runtime_backend>;
INSTANTIATE_TYPED_TEST_SUITE_P(cuda, runtime_properties, cuda_types);

}  // namespace taskswap::test
