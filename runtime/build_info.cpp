// SPDX-License-Identifier: Apache-2.0
#include "comm/library_versions.hpp"
#include "device/cuda/cuda_backend.hpp"

#include <taskswap/build_info.hpp>

namespace taskswap {

build_info build_features()
{
  build_info info;
  info.version = TASKSWAP_VERSION;
  info.cuda = TASKSWAP_WITH_CUDA != 0;
  info.nccl = TASKSWAP_WITH_NCCL != 0;
  info.mpi = TASKSWAP_WITH_MPI != 0;
  return info;
}

build_info get_build_info()
{
  build_info info = build_features();
  info.cuda_runtime_version = detail::cuda_runtime_version();
  info.cuda_driver_version = detail::cuda_driver_version();
  const detail::nccl_status nccl = detail::nccl_version();
  info.nccl_version = nccl.version;
  info.nccl_library = nccl.library;
  info.mpi_library_version = detail::mpi_library_version();
  return info;
}

}  // namespace taskswap
