// SPDX-License-Identifier: Apache-2.0
#include "runtime_properties.hpp"

namespace taskswap::test {

struct cuda_runtime_backend {
  static std::string skip_reason()
  {
    const build_info info = get_build_info();
    if (!info.cuda) { return "taskswap was built without CUDA (TASKSWAP_CUDA=OFF)"; }
    if (cuda_device_count() == 0) {
      return "no CUDA device visible (driver " + info.cuda_driver_version +
             "); run tools/gpu-check on a machine with a GPU";
    }
    return {};
  }
  static device make(std::size_t /*budget*/) { return cuda_device(0); }
};

using cuda_types = ::testing::Types<cuda_runtime_backend>;
INSTANTIATE_TYPED_TEST_SUITE_P(cuda, runtime_properties, cuda_types);

}  // namespace taskswap::test
