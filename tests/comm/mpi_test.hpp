// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the multi-rank GoogleTest programs share (mpi_test_main.cpp holds their main: MPI with
// MPI_THREAD_MULTIPLE, one report from rank 0, and a failure on any rank fails every rank).

namespace taskswap::test {

[[nodiscard]] int world_rank();
[[nodiscard]] int world_size();

}  // namespace taskswap::test
