// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Communicators: allreduce of gradient slabs and of small integer vectors, and a
/// barrier, asynchronous on a stream, over NCCL (CUDA buffers) or MPI (the emulated backend's
/// buffers). Every collective is watched: one that does not finish within the timeout aborts the
/// communicator, and the next call (or check()) throws timeout_error naming what it was reducing.
/// The runtime's reducer uses a communicator; a trainer passes one to the runtime or names the
/// backend in the [comm] section of its configuration.

#include <taskswap/device.hpp>
#include <taskswap/dtype.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace taskswap {

/// @brief How gradients are averaged across ranks (the runtime's reducer).
enum class average_mode : std::uint8_t { contributors, world };
/// @brief The communicator backend (the runtime's reducer).
enum class comm_backend : std::uint8_t { none, nccl, mpi };

/// @brief How replicas start equal, at the first plan() with a communicator: rank 0's home
/// copies are broadcast to every rank (as DDP does at construction), or every rank's are compared
/// with rank 0's (per-unit checksums) and a difference refused naming the units and ranks.
enum class initial_sync : std::uint8_t { broadcast, verify };

/// @brief Communicator and reducer options.
struct comm_options {
  comm_backend backend = comm_backend::none;
  std::size_t bucket_cap = std::size_t{25} << 20;
  average_mode average = average_mode::contributors;
  std::chrono::milliseconds timeout{300'000};
  /// Reduce and update every unit every step, zeros included ([comm] reduce = "every_unit"): the
  /// gradient bytes DDP moves, for cost comparisons. Not DDP's numerics: DDP leaves a parameter no
  /// rank used without a gradient (torch's AdamW then skips it), while this decays it and moves
  /// its moments. DDP's numerics are the default reducer with average = world.
  bool reduce_every_unit = false;
  initial_sync initial = initial_sync::broadcast;  ///< how replicas start equal ([comm] initial)
};

/// @brief How the ranks' values are combined.
enum class reduce_op : std::uint8_t {
  sum,  ///< x = sum over ranks of x_r
  average,  ///< x = sum over ranks of x_r / size()
  premul_sum,  ///< x = sum over ranks of (factor * x_r): the factor is applied before the sum
};

/// @brief One slab of a grouped allreduce (communicator::allreduce_many).
struct reduce_item {
  device_span data;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  double factor = 1.0;  ///< premul_sum only
};

/// @brief A group of ranks that reduce together. Calls on one communicator are issued by one
/// thread and in the same order on every rank (as for NCCL and MPI); use split() for a second,
/// independent channel.
class communicator {
 public:
  virtual ~communicator() = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  communicator(communicator&&) = delete;
  communicator& operator=(communicator&&) = delete;

  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  [[nodiscard]] virtual comm_backend backend() const noexcept = 0;
  /// @brief The collectives' timeout.
  [[nodiscard]] virtual std::chrono::milliseconds timeout() const noexcept = 0;

  /// @brief In-place allreduce of `data` (elements of `type`) on `s`, after the work queued on
  /// `s` before it. `what` names the data in errors ("unit 'head3', step 12"). Does not
  /// synchronise. `factor` is used by premul_sum only.
  /// @throws invalid_argument if `data` is not this communicator's kind of memory, or its size is
  /// not a multiple of the element size
  /// @throws timeout_error, comm_error for an earlier collective that failed
  void allreduce(device_span data, dtype type, reduce_op op, double factor, stream_view s, std::string_view what)
  {
    const reduce_item item{data, type, op, factor};
    allreduce_many(std::span<const reduce_item>(&item, 1), s, what);
  }

  /// @brief Several in-place allreduces issued as one group (one NCCL launch; concurrent MPI
  /// requests), watched as one collective.
  virtual void allreduce_many(std::span<const reduce_item> items, stream_view s, std::string_view what) = 0;

  /// @brief In-place sum of a small integer vector in host memory, on `s`: the result is there
  /// once the work queued on `s` so far has completed. `values` stays valid until then.
  virtual void allreduce_counts(std::span<std::int64_t> values, stream_view s, std::string_view what) = 0;

  /// @brief In-place broadcast of `data`'s bytes from rank `root` to every rank, on `s`, after
  /// the work queued on `s` before it. Does not synchronise.
  /// @throws invalid_argument if `data` is not this communicator's kind of memory or `root` is
  /// not a rank
  virtual void broadcast(device_span data, int root, stream_view s, std::string_view what) = 0;

  /// @brief Every rank reaches this point of `s` before any continues past it.
  virtual void barrier(stream_view s) = 0;

  /// @brief A second communicator over the same ranks whose collectives are independent of this
  /// one's (MPI_Comm_dup, ncclCommSplit). Collective: every rank calls it.
  [[nodiscard]] virtual std::unique_ptr<communicator> split() = 0;

  /// @brief Rethrows the first failure a collective met: timeout_error (it did not finish within
  /// the timeout; the communicator was aborted) or comm_error. Cheap; call it often.
  virtual void check() const = 0;
  /// @brief Whether a collective failed (and the communicator was aborted).
  [[nodiscard]] virtual bool failed() const noexcept = 0;

 protected:
  communicator() = default;
};

/// @brief The NCCL library taskswap uses: the file and the version it reports ("2.28.3").
struct nccl_library_info {
  std::string path;
  std::string version;
};

/// @brief Loads the NCCL taskswap calls, if not yet loaded, and says which it is. taskswap does
/// not link NCCL: it loads it at first use, taking, in order, the file the environment variable
/// TASKSWAP_NCCL_LIBRARY names; an NCCL the process has loaded already (PyTorch's, once torch is
/// imported); the file prefer_nccl_library() named; the NCCL taskswap was built against; and
/// `libnccl.so.2` on the loader's path. So importing taskswap before torch never puts an older
/// NCCL in the way of torch's. A communicator passed to make_nccl_communicator(dev, ncclComm_t)
/// must come from this library.
/// @throws comm_error naming each file tried and why it failed, or when built without NCCL
[[nodiscard]] nccl_library_info nccl_library();

/// @brief The NCCL file to try before the one taskswap was built against, when neither the
/// environment nor the process has chosen one (the Python package names the `nvidia-nccl`
/// wheel's, PyTorch's). Without effect once NCCL is loaded.
void prefer_nccl_library(const std::string& path);

/// @brief The bytes of an NCCL unique id (ncclUniqueId), made by rank 0 and sent to the others.
using nccl_unique_id = std::array<char, 128>;

/// @brief A new NCCL unique id (rank 0 calls it and shares the bytes).
/// @throws comm_error if taskswap was built without NCCL or NCCL fails
[[nodiscard]] nccl_unique_id make_nccl_unique_id();

/// @brief An MPI communicator over MPI_COMM_WORLD (duplicated), for emulated devices. Initialises
/// MPI (MPI_THREAD_MULTIPLE) if the program has not; taskswap then finalises it at exit.
/// @throws comm_error if taskswap was built without MPI, or MPI fails
[[nodiscard]] std::shared_ptr<communicator> make_mpi_communicator(const device& dev, std::chrono::milliseconds timeout);

/// @brief An NCCL communicator for `dev` (a cuda device) from a unique id, this rank and the size.
/// @throws comm_error if taskswap was built without NCCL or the initialisation fails
[[nodiscard]] std::shared_ptr<communicator> make_nccl_communicator(const device& dev, const nccl_unique_id& id,
                                                                   int rank, int size,
                                                                   std::chrono::milliseconds timeout);

/// @brief Wraps an existing ncclComm_t (passed as a pointer) that the caller keeps and destroys.
/// The watchdog still aborts it on a timeout (ncclCommAbort frees it): once failed() is true, the
/// caller must not destroy it again.
[[nodiscard]] std::shared_ptr<communicator> make_nccl_communicator(const device& dev, void* nccl_comm,
                                                                   std::chrono::milliseconds timeout);

/// @brief An NCCL communicator whose unique id rank 0 of MPI_COMM_WORLD makes and broadcasts.
[[nodiscard]] std::shared_ptr<communicator> make_nccl_communicator_over_mpi(const device& dev,
                                                                            std::chrono::milliseconds timeout);

/// @brief The communicator `options.backend` names: mpi over MPI_COMM_WORLD, nccl bootstrapped
/// over MPI, or none (nullptr).
/// @throws config_error if the backend does not suit the device (nccl needs cuda, mpi emulated)
[[nodiscard]] std::shared_ptr<communicator> make_communicator(const device& dev, const comm_options& options);

}  // namespace taskswap
