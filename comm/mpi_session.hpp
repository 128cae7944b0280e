// SPDX-License-Identifier: Apache-2.0
#pragma once

// MPI as taskswap uses it: initialised once (MPI_THREAD_MULTIPLE, finalised at exit when
// taskswap initialised it), and the two world-level calls the NCCL bootstrap needs. Without MPI
// in the build, each throws comm_error saying so.

#include <utility>

namespace taskswap::detail {

/// Initialises MPI unless the program did; requires MPI_THREAD_MULTIPLE.
void ensure_mpi();
/// {rank, size} in MPI_COMM_WORLD.
[[nodiscard]] std::pair<int, int> mpi_world_rank_size();
/// Broadcasts `bytes` bytes from rank 0 of MPI_COMM_WORLD.
void mpi_broadcast_bytes(void* data, int bytes);

}  // namespace taskswap::detail
