// SPDX-License-Identifier: Apache-2.0
#pragma once

// The versions the communication libraries report at run time.

#include <string>

namespace taskswap::detail {

struct nccl_status {
  std::string version;  // "2.28.3" from ncclGetVersion; empty without NCCL or when none loads
  std::string library;  // the file loaded, or why none could be; empty without NCCL
};

/// The NCCL taskswap uses, loading it (comm/nccl_library.hpp); never throws.
[[nodiscard]] nccl_status nccl_version();

/// The first line of MPI_Get_library_version, or empty when MPI is not built in.
[[nodiscard]] std::string mpi_library_version();

}  // namespace taskswap::detail
