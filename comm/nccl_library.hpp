// SPDX-License-Identifier: Apache-2.0
#pragma once

// The NCCL library taskswap calls, loaded at run time.
//
// Note [NCCL at run time]: libtaskswap has no link-time dependency on libnccl.so.2. A process
// holds one library per soname, and the first to load `libnccl.so.2` decides for everyone: when
// `import taskswap` loaded the system's NCCL (2.28) first, PyTorch's libtorch_cuda.so, built for
// its own wheel's NCCL (2.30), failed to load (`undefined symbol: ncclCommResume`). So NCCL is
// opened with dlopen (RTLD_LOCAL) the first time taskswap needs it, and the library chosen is,
// in order:
//   1. the file TASKSWAP_NCCL_LIBRARY names, if that variable is set (nothing else is tried);
//   2. an NCCL the process has loaded already (PyTorch's, once torch is imported);
//   3. the file prefer_nccl_library() named (the Python package names the `nvidia-nccl` wheel's,
//      the one torch would load, when it is installed);
//   4. the NCCL taskswap was built against (its absolute path);
//   5. `libnccl.so.2` on the loader's search path.
// Every function is called through this table. A communicator taskswap borrows
// (make_nccl_communicator over an ncclComm_t) must come from the same library.

#include <nccl.h>

#include <string>

namespace taskswap::detail {

struct nccl_library {
  std::string path;  // the file loaded (as dlinfo reports it)
  int version = 0;  // ncclGetVersion: major * 10000 + minor * 100 + patch
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  decltype(&::ncclGetLastError) get_last_error = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&::ncclCommSplit) comm_split = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&::ncclCommCount) comm_count = nullptr;
  decltype(&::ncclCommUserRank) comm_user_rank = nullptr;
  decltype(&::ncclAllReduce) all_reduce = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  decltype(&::ncclRedOpCreatePreMulSum) red_op_create_pre_mul_sum = nullptr;
  decltype(&::ncclRedOpDestroy) red_op_destroy = nullptr;

  [[nodiscard]] std::string version_text() const;
};

/// The oldest NCCL taskswap calls (ncclCommSplit came in 2.18).
inline constexpr int nccl_minimum_version = 21800;

/// The process's NCCL, loaded on the first call (thread-safe; see the note above).
/// @throws comm_error naming every file tried and why each failed, or an NCCL older than 2.18
[[nodiscard]] const nccl_library& nccl();

/// Names the file to try third (see the note), before the first nccl(); later calls change
/// nothing once NCCL is loaded. An empty path clears it.
void prefer_nccl_library(std::string path);

/// Whether nccl() has loaded NCCL already (it loads nothing).
[[nodiscard]] bool nccl_loaded() noexcept;

}  // namespace taskswap::detail
