// SPDX-License-Identifier: Apache-2.0
#include "comm/library_versions.hpp"

#include "device/message.hpp"

#include <taskswap/error.hpp>

#include <array>

#if TASKSWAP_WITH_NCCL
#include "comm/nccl_library.hpp"
#endif
#if TASKSWAP_WITH_MPI
#include <mpi.h>
#endif

namespace taskswap::detail {

nccl_status nccl_version()
{
#if TASKSWAP_WITH_NCCL
  try {
    const nccl_library& lib = nccl();
    return {lib.version_text(), lib.path};
  } catch (const comm_error& e) {
    return {{}, e.what()};
  }
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
