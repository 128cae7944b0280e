// SPDX-License-Identifier: Apache-2.0
#include "kernels_conformance.hpp"

namespace taskswap::test {

struct cuda_kernels {
  static constexpr bool large = true;
  static std::string skip_reason()
  {
    if (!get_build_info().cuda) { return "taskswap was built without CUDA (TASKSWAP_CUDA=OFF)"; }
    if (cuda_device_count() == 0) { return "no CUDA device visible; run tools/gpu-check on a machine with a GPU"; }
    return {};
  }
  static device make() { return cuda_device(0); }
};

using cuda_types = ::testing::Types<cuda_kernels>;
INSTANTIATE_TYPED_TEST_SUITE_P(cuda, kernels_conformance, cuda_types);

}  // namespace taskswap::test
