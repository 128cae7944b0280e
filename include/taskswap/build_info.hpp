// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief What this build of taskswap contains: version, backends, and the versions of the
/// libraries it uses, as those libraries report them at run time.

#include <string>

namespace taskswap {

/// @brief The contents of this build.
struct build_info {
  std::string version;  ///< taskswap's own version
  bool cuda = false;  ///< the cuda backend is built in
  bool nccl = false;  ///< the NCCL communicator is built in (NCCL itself is loaded at run time)
  bool mpi = false;  ///< MPI is linked
  std::string cuda_runtime_version;  ///< "13.0", or empty without CUDA
  std::string cuda_driver_version;  ///< "13.0", or "none" where no driver is installed
  std::string nccl_version;  ///< "2.28.3" (the library loaded), or empty without NCCL or when none loads
  std::string nccl_library;  ///< the NCCL file taskswap loaded, or why none could be (see comm.hpp)
  std::string mpi_library_version;  ///< the first line MPI reports, or empty without MPI
};

/// @brief Describes this build and queries the libraries it uses; loads NCCL (as the first NCCL
/// communicator would) to report its version. Never throws for a missing driver or NCCL.
[[nodiscard]] build_info get_build_info();

/// @brief The version and the backends built in, without querying or loading any library.
[[nodiscard]] build_info build_features();

}  // namespace taskswap
