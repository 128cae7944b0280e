// SPDX-License-Identifier: Apache-2.0
// Choosing a communicator from the options, and what the factories say in a build without NCCL
// or MPI.

#include <taskswap/comm.hpp>

#include "comm/mpi_session.hpp"
#include "device/message.hpp"

namespace taskswap {

std::shared_ptr<communicator> make_communicator(const device& dev, const comm_options& options)
{
  switch (options.backend) {
    case comm_backend::none: return nullptr;
    case comm_backend::mpi: return make_mpi_communicator(dev, options.timeout);
    case comm_backend::nccl: return make_nccl_communicator_over_mpi(dev, options.timeout);
  }
  return nullptr;
}

#if !TASKSWAP_WITH_NCCL
namespace {
[[noreturn]] void no_nccl()
{
  throw comm_error("taskswap was built without NCCL; rebuild with the CUDA toolkit and NCCL (TASKSWAP_NCCL=ON, "
                   "NCCL_ROOT=<prefix>) or set [comm] backend = \"mpi\" on an emulated device");
}
}  // namespace

nccl_unique_id make_nccl_unique_id() { no_nccl(); }
nccl_library_info nccl_library() { no_nccl(); }
void prefer_nccl_library(const std::string&) {}
std::shared_ptr<communicator> make_nccl_communicator(const device&, const nccl_unique_id&, int, int,
                                                     std::chrono::milliseconds)
{
  no_nccl();
}
std::shared_ptr<communicator> make_nccl_communicator(const device&, void*, std::chrono::milliseconds) { no_nccl(); }
std::shared_ptr<communicator> make_nccl_communicator_over_mpi(const device&, std::chrono::milliseconds) { no_nccl(); }
#endif

#if !TASKSWAP_WITH_MPI
namespace {
[[noreturn]] void no_mpi()
{
  throw comm_error("taskswap was built without MPI; install libopenmpi-dev (tools/setup) and rebuild, or set "
                   "[comm] backend = \"none\"");
}
}  // namespace

std::shared_ptr<communicator> make_mpi_communicator(const device&, std::chrono::milliseconds) { no_mpi(); }

namespace detail {
void ensure_mpi() { no_mpi(); }
std::pair<int, int> mpi_world_rank_size() { no_mpi(); }
void mpi_broadcast_bytes(void*, int) { no_mpi(); }
}  // namespace detail
#endif

}  // namespace taskswap
