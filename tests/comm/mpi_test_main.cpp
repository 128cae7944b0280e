// SPDX-License-Identifier: Apache-2.0
#include "mpi_test.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace taskswap::test {

int world_rank()
{
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size()
{
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace taskswap::test

int main(int argc, char** argv)
{
  ::testing::InitGoogleTest(&argc, argv);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (taskswap::test::world_rank() != 0) {  // one report; failures on other ranks still fail the run
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (result != 0) { std::fprintf(stderr, "rank %d: tests failed\n", taskswap::test::world_rank()); }
  MPI_Finalize();
  return worst;
}
