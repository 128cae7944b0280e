// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief What this build of taskswap contains: version, backends, and the versions of the
/// libraries it was linked with, as those libraries report them at run time.

#include <string>

namespace taskswap {

/// @brief The contents of this build.
struct build_info {
  std::string version;               ///< taskswap's own version
  bool cuda = false;                 ///< the cuda backend is built in
  bool nccl = false;                 ///< NCCL is linked
  bool mpi = false;                  ///< MPI is linked
  std::string cuda_runtime_version;  ///< "13.0", or empty without CUDA
  std::string cuda_driver_version;   ///< "13.0", or "none" where no driver is installed
  std::string nccl_version;          ///< "2.28.3", or empty without NCCL
  std::string mpi_library_version;   ///< the first line MPI reports, or empty without MPI
};

/// @brief Describes this build; queries the linked libraries. Never throws for a missing driver.
[[nodiscard]] build_info get_build_info();

}  // namespace taskswap
