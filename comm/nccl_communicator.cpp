// SPDX-License-Identifier: Apache-2.0
// The NCCL communicator, for CUDA buffers.
//
// Collectives are enqueued on the caller's stream between two events. A watchdog thread polls
// them: once a collective's start event has completed, it has `timeout` to finish; if it does not,
// or NCCL reports an asynchronous error (ncclCommGetAsyncError), the watchdog aborts the
// communicator (ncclCommAbort makes its kernels return, so no stream waits forever) and keeps the
// error, which the next call, or check(), throws with the name of what was being reduced.

#include <taskswap/comm.hpp>

#include "comm/comm_failure.hpp"
#include "comm/mpi_session.hpp"
#include "comm/nccl_library.hpp"
#include "comm/reduce_checks.hpp"
#include "device/cuda/cuda_device_guard.hpp"
#include "device/expects.hpp"
#include "device/log.hpp"
#include "device/message.hpp"
#include "kernels/kernels.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace taskswap {
namespace detail {
namespace {

using clock = std::chrono::steady_clock;

void check_nccl(ncclResult_t rc, const char* call, std::string_view what = {})
{
  if (rc != ncclSuccess) {
    throw comm_error(message("taskswap: ", call, what.empty() ? "" : " (", what, what.empty() ? "" : ")",
                             " failed: ", nccl().get_error_string(rc), "; ", nccl().get_last_error(nullptr)));
  }
}

ncclDataType_t nccl_type(dtype t)
{
  switch (t) {
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::f32:
    case dtype::u8: break;  // u8 is refused by check_reduce_item
  }
  return ncclFloat32;
}

class nccl_communicator final : public communicator {
 public:
  nccl_communicator(device dev, ncclComm_t comm, bool owned, std::chrono::milliseconds timeout)
      : device_(std::move(dev)), comm_(comm), owned_(owned), timeout_(timeout), scratch_(device_, flag_bytes + 64)
  {
    check_nccl(nccl().comm_user_rank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(nccl().comm_count(comm_, &size_), "ncclCommCount");
    watchdog_ = std::thread([this] { watch(); });
  }
  ~nccl_communicator() override
  {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    if (owned_ && !aborted_) {
      const ncclResult_t rc = nccl().comm_destroy(comm_);
      if (rc != ncclSuccess) {
        log(log_level::warning, message("taskswap: ncclCommDestroy: ", nccl().get_error_string(rc)));
      }
    }
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  comm_backend backend() const noexcept override { return comm_backend::nccl; }
  std::chrono::milliseconds timeout() const noexcept override { return timeout_; }

  void allreduce_many(std::span<const reduce_item> items, stream_view s, std::string_view what) override
  {
    check();
    for (const reduce_item& it : items) {
      check_reduce_item(it, device_, "NCCL", what,
                        "the nccl backend reduces cuda buffers, use mpi for emulated devices");
    }
    // A 16-bit factor would bias every average (1/3 is 0.33398 in bf16): 16-bit slabs are scaled
    // in f32 first (the MPI path's rounding) and then summed.
    for (const reduce_item& it : items) {
      if (it.op == reduce_op::premul_sum && it.type != dtype::f32) {
        detail::unscale_and_check_async(it.data.data(), it.type, it.data.size() / size_of(it.type),
                                        static_cast<float>(it.factor), flag(), s);
      }
    }
    watched(s, message("allreduce of ", what), [&](cudaStream_t cs) {
      check_nccl(nccl().group_start(), "ncclGroupStart", what);
      std::vector<ncclRedOp_t> premuls;
      ncclResult_t rc = ncclSuccess;
      for (const reduce_item& it : items) {
        const std::size_t count = it.data.size() / size_of(it.type);
        const ncclDataType_t t = nccl_type(it.type);
        ncclRedOp_t op = it.op == reduce_op::average ? ncclAvg : ncclSum;
        if (it.op == reduce_op::premul_sum && it.type == dtype::f32) {
          // A host-immediate scalar of the data's type, read during the call.
          float factor = static_cast<float>(it.factor);
          rc = nccl().red_op_create_pre_mul_sum(&op, &factor, t, ncclScalarHostImmediate, comm_);
          if (rc != ncclSuccess) { break; }
          premuls.push_back(op);
        }
        rc = nccl().all_reduce(it.data.data(), it.data.data(), count, t, op, comm_, cs);
        if (rc != ncclSuccess) { break; }
      }
      const ncclResult_t end = nccl().group_end();
      for (const ncclRedOp_t op : premuls) { nccl().red_op_destroy(op, comm_); }
      check_nccl(rc, "ncclAllReduce", what);
      check_nccl(end, "ncclGroupEnd", what);
    });
  }

  void allreduce_counts(std::span<std::int64_t> values, stream_view s, std::string_view what) override
  {
    check();
    const std::size_t bytes = values.size_bytes();
    if (scratch_.size() < bytes + flag_bytes) {
      // Queued work may still use the old scratch: keep it until the communicator goes (growth
      // happens a few times at most; no host wait for the device).
      retired_.push_back(std::move(scratch_));
      scratch_ = device_buffer(device_, bytes + flag_bytes);
    }
    const device_span d = scratch_.span(flag_bytes, bytes);
    copy_async(d, std::as_bytes(values), s);
    watched(s, message("count allreduce of ", what), [&](cudaStream_t cs) {
      check_nccl(nccl().all_reduce(d.data(), d.data(), values.size(), ncclInt64, ncclSum, comm_, cs), "ncclAllReduce",
                 what);
    });
    copy_async(std::as_writable_bytes(values), const_device_span(d), s);
  }

  void broadcast(device_span data, int root, stream_view s, std::string_view what) override
  {
    check();
    check_broadcast(data, root, size_, device_, "NCCL", what, "give a buffer of the communicator's device");
    if (data.size() == 0) { return; }
    watched(s, message("broadcast of ", what), [&](cudaStream_t cs) {
      check_nccl(nccl().broadcast(data.data(), data.data(), data.size(), ncclUint8, root, comm_, cs), "ncclBroadcast",
                 what);
    });
  }

  void barrier(stream_view s) override
  {
    check();
    const device_span d = scratch_.span(flag_bytes, sizeof(std::int64_t));
    watched(s, "barrier", [&](cudaStream_t cs) {
      check_nccl(nccl().all_reduce(d.data(), d.data(), 1, ncclInt64, ncclSum, comm_, cs), "ncclAllReduce", "barrier");
    });
  }

  std::unique_ptr<communicator> split() override
  {
    check();
    const cuda_device_guard guard(device_.index());
    ncclComm_t child = nullptr;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    check_nccl(nccl().comm_split(comm_, 0, rank_, &child, &config), "ncclCommSplit");
    return std::make_unique<nccl_communicator>(device_, child, true, timeout_);
  }

  void check() const override { failure_.rethrow(); }
  bool failed() const noexcept override { return failure_.failed(); }

 private:
  struct pending {
    event start;
    event end;
    std::string what;
    std::optional<clock::time_point> started;
  };

  template <typename Enqueue>
  void watched(stream_view s, std::string what, Enqueue enqueue)
  {
    TASKSWAP_EXPECTS(&s.backend() == &device_.backend(),
                     message("NCCL ", what, ": the stream is not on the communicator's device"));
    const cuda_device_guard guard(device_.index());
    pending p{event(device_), event(device_), std::move(what), std::nullopt};
    p.start.record(s);
    // Not under mutex_: a call that blocks in NCCL (a peer missing at connection set-up) must
    // leave the watchdog free to abort the communicator, which makes the call return.
    failure_.rethrow();
    enqueue(static_cast<cudaStream_t>(s.native_handle()));
    p.end.record(s);
    {
      const std::lock_guard lock(mutex_);
      pending_.push_back(std::move(p));
    }
    wake_.notify_all();
  }

  void watch()
  {
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      wake_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 5));
      if (aborted_) { continue; }
      ncclResult_t async = ncclSuccess;
      if (nccl().comm_get_async_error(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        abort_with(comm_error(message("taskswap: NCCL reported an asynchronous error on rank ", rank_, " of ", size_,
                                      (pending_.empty() ? std::string() : " during " + pending_.front().what), ": ",
                                      nccl().get_error_string(async), "; the communicator is aborted")));
        continue;
      }
      const auto now = clock::now();
      while (!pending_.empty()) {
        pending& p = pending_.front();
        if (p.end.query()) {
          pending_.pop_front();
          continue;
        }
        if (!p.started && p.start.query()) { p.started = now; }
        if (p.started && now - *p.started > timeout_) {
          abort_with(timeout_error(message("taskswap: NCCL ", p.what, " did not finish within ", timeout_.count(),
                                           " ms on rank ", rank_, " of ", size_,
                                           ": another rank died, stalled or issued a different collective; the "
                                           "communicator is aborted. Look for the first error on the other ranks; "
                                           "raise [comm] timeout only if a step legitimately takes longer")));
        }
        break;
      }
    }
  }

  template <typename E>
  void abort_with(E e)  // mutex_ held
  {
    failure_.fail(std::make_exception_ptr(e));
    log(log_level::warning, e.what());
    aborted_ = true;
    const ncclResult_t rc = nccl().comm_abort(comm_);  // its kernels return; the streams drain
    if (rc != ncclSuccess) {
      log(log_level::warning, message("taskswap: ncclCommAbort: ", nccl().get_error_string(rc)));
    }
    pending_.clear();
  }

  device device_;
  ncclComm_t comm_;
  bool owned_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0;
  int size_ = 1;
  static constexpr std::size_t flag_bytes = 256;  // the scaling kernel's non-finite flag, then the counts
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): its first bytes
  [[nodiscard]] int* flag() { return reinterpret_cast<int*>(scratch_.data()); }
  device_buffer scratch_;
  std::vector<device_buffer> retired_;
  comm_failure failure_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<pending> pending_;
  bool stopping_ = false;
  bool aborted_ = false;
  std::thread watchdog_;
};

void require_cuda(const device& dev)
{
  if (dev.kind() != backend_kind::cuda) {
    throw config_error(message("taskswap: the nccl communicator reduces cuda buffers, and ", dev.name(),
                               " is emulated; set [comm] backend = \"mpi\""));
  }
}

}  // namespace
}  // namespace detail

nccl_library_info nccl_library()
{
  const detail::nccl_library& lib = detail::nccl();
  return {lib.path, lib.version_text()};
}

void prefer_nccl_library(const std::string& path) { detail::prefer_nccl_library(path); }

nccl_unique_id make_nccl_unique_id()
{
  ncclUniqueId id;
  detail::check_nccl(detail::nccl().get_unique_id(&id), "ncclGetUniqueId");
  nccl_unique_id out{};
  static_assert(sizeof(id) == sizeof(out));
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

std::shared_ptr<communicator> make_nccl_communicator(const device& dev, const nccl_unique_id& id, int rank, int size,
                                                     std::chrono::milliseconds timeout)
{
  detail::require_cuda(dev);
  TASKSWAP_EXPECTS(size > 0 && rank >= 0 && rank < size, detail::message("NCCL rank ", rank, " of ", size));
  TASKSWAP_EXPECTS(timeout.count() > 0,
                   detail::message("communicator timeout ", timeout.count(), " ms; give a positive timeout"));
  const detail::cuda_device_guard guard(dev.index());
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), sizeof(nid));
  ncclComm_t comm = nullptr;
  detail::check_nccl(detail::nccl().comm_init_rank(&comm, size, nid, rank), "ncclCommInitRank");
  return std::make_shared<detail::nccl_communicator>(dev, comm, true, timeout);
}

std::shared_ptr<communicator> make_nccl_communicator(const device& dev, void* nccl_comm,
                                                     std::chrono::milliseconds timeout)
{
  detail::require_cuda(dev);
  TASKSWAP_EXPECTS(nccl_comm != nullptr, "make_nccl_communicator: the ncclComm_t is null");
  TASKSWAP_EXPECTS(timeout.count() > 0,
                   detail::message("communicator timeout ", timeout.count(), " ms; give a positive timeout"));
  return std::make_shared<detail::nccl_communicator>(dev, static_cast<ncclComm_t>(nccl_comm), false, timeout);
}

std::shared_ptr<communicator> make_nccl_communicator_over_mpi(const device& dev, std::chrono::milliseconds timeout)
{
  detail::require_cuda(dev);
  const auto [rank, size] = detail::mpi_world_rank_size();
  nccl_unique_id id{};
  if (rank == 0) { id = make_nccl_unique_id(); }
  detail::mpi_broadcast_bytes(id.data(), static_cast<int>(id.size()));
  return make_nccl_communicator(dev, id, rank, size, timeout);
}

}  // namespace taskswap
