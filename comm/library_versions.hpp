// SPDX-License-Identifier: Apache-2.0
#pragma once

// The versions the communication libraries report at run time.

#include <string>

namespace taskswap::detail {

/// "2.28.3" from ncclGetVersion, or empty when NCCL is not built in.
[[nodiscard]] std::string nccl_version();

/// The first line of MPI_Get_library_version, or empty when MPI is not built in.
[[nodiscard]] std::string mpi_library_version();

}  // namespace taskswap::detail
