// SPDX-License-Identifier: Apache-2.0
#include "comm/library_versions.hpp"

#include "device/message.hpp"

#include <taskswap/error.hpp>

#include <array>

#if TASKSWAP_WITH_NCCL
#include <nccl.h>
#endif
#if TASKSWAP_WITH_MPI
#include <mpi.h>
#endif

namespace taskswap::detail {

std::string nccl_version()
{
#if TASKSWAP_WITH_NCCL
  int code = 0;
  const ncclResult_t status = ncclGetVersion(&code);
  if (status != ncclSuccess) {
    throw comm_error(message("taskswap: ncclGetVersion failed: ", ncclGetErrorString(status)));
  }
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return message(code / 10000, ".", (code % 10000) / 100, ".", code % 100);
#else
  return {};
#endif
}

std::string mpi_library_version()
{
#if TASKSWAP_WITH_MPI
  std::array<char, MPI_MAX_LIBRARY_VERSION_STRING> text{};
  int length = 0;
  const int status = MPI_Get_library_version(text.data(), &length);  // callable before MPI_Init
  if (status != MPI_SUCCESS) {
    throw comm_error(message("taskswap: MPI_Get_library_version failed with code ", status));
  }
  std::string version(text.data(), static_cast<std::size_t>(length));
  const auto end_of_line = version.find_first_of("\r\n,");
  return version.substr(0, end_of_line);
#else
  return {};
#endif
}

}  // namespace taskswap::detail
