// SPDX-License-Identifier: Apache-2.0
// The MPI communicator, for the emulated backend, whose "device" memory is host memory.
//
// A collective is a host function on the caller's stream: it starts a non-blocking MPI
// collective and polls it (MPI_Test, backing off to short sleeps) until it completes, the
// communicator fails, or the timeout passes. So the stream's order is the collective's order, no
// thread blocks forever in MPI, and a rank that died or stalled ends in a timeout_error on the
// others instead of a hang. The library needs MPI_THREAD_MULTIPLE (the reducer's two channels
// run on two stream threads, and the trainer may call MPI too).

#include <taskswap/comm.hpp>

#include "comm/comm_failure.hpp"
#include "comm/mpi_session.hpp"
#include "comm/reduce_checks.hpp"
#include "device/backend.hpp"
#include "device/expects.hpp"
#include "device/message.hpp"
#include "numeric/dtype_conversion.hpp"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace taskswap {
namespace detail {
namespace {

std::atomic<bool> any_failed{false};  // finalising MPI after a failed collective could hang

// Open MPI progresses every pending non-blocking request of the process from whichever thread
// calls into it: one stream's MPI_Testall can complete another stream's collective, writing its
// result (or running the f16/bf16 sum on it) on the wrong thread. The owner then learns of the
// completion through Open MPI's own state, which ThreadSanitizer cannot see, so that write and the
// reads behind the owner's event look unordered. Each start and each MPI_Testall of a collective
// holds this lock, which makes the hand-off an ordinary one: the thread that sees a request done
// took the lock after the thread that completed it let it go. None of them waits for the other
// ranks (a test may run the f16/bf16 sum of a bucket). The blocking calls of set-up and teardown
// (MPI_Comm_dup in split(), MPI_Comm_free, the set-up broadcast) do not take it: holding it while
// the other ranks are awaited would stop this rank's streams from starting their parts.
std::mutex progress_mutex;
bool initialised_here = false;
int thread_level = MPI_THREAD_SINGLE;

void finalize_at_exit()
{
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0 && !any_failed.load()) { MPI_Finalize(); }
}

std::string mpi_error_text(int code)
{
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) { return message("MPI error code ", code); }
  return std::string(text, static_cast<std::size_t>(length));
}

// bf16 and f16 sums: widened to f32, added, rounded to nearest even.
template <dtype T>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*)
{
  for (std::size_t i = 0; i < static_cast<std::size_t>(*len); ++i) {
    narrow_element(inout, T, i, widen_element(in, T, i) + widen_element(inout, T, i));
  }
}

struct half_ops {
  MPI_Op bf16 = MPI_OP_NULL;
  MPI_Op f16 = MPI_OP_NULL;
};

const half_ops& user_ops()
{
  static const half_ops ops = [] {
    half_ops o;
    MPI_Op_create(&half_sum<dtype::bf16>, 1, &o.bf16);
    MPI_Op_create(&half_sum<dtype::f16>, 1, &o.f16);
    return o;
  }();
  return ops;
}

}  // namespace

void ensure_mpi()
{
  static std::once_flag once;
  std::call_once(once, [] {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (initialised == 0) {
      int provided = 0;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) { throw comm_error(message("taskswap: MPI_Init_thread failed: ", mpi_error_text(rc))); }
      initialised_here = true;
      std::atexit(finalize_at_exit);
    }
    MPI_Query_thread(&thread_level);
    if (thread_level < MPI_THREAD_MULTIPLE) {
      throw comm_error(message("taskswap: MPI provides thread level ", thread_level, " (MPI_THREAD_MULTIPLE is ",
                               MPI_THREAD_MULTIPLE,
                               "); taskswap calls MPI from its stream threads while the "
                               "trainer may call it too. Initialise MPI with MPI_Init_thread(..., "
                               "MPI_THREAD_MULTIPLE, ...), or let taskswap initialise it, with an MPI built "
                               "with thread support"));
    }
  });
}

void check_mpi(int rc, const char* call)
{
  if (rc != MPI_SUCCESS) { throw comm_error(message("taskswap: ", call, " failed: ", mpi_error_text(rc))); }
}

void mpi_broadcast_bytes(void* data, int bytes)
{
  ensure_mpi();
  check_mpi(MPI_Bcast(data, bytes, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
}

std::pair<int, int> mpi_world_rank_size()
{
  ensure_mpi();
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return {rank, size};
}

namespace {

constexpr std::size_t broadcast_piece = std::size_t{1} << 30;  // MPI counts are ints

class mpi_communicator final : public communicator {
 public:
  mpi_communicator(device dev, MPI_Comm parent, std::chrono::milliseconds timeout)
      : device_(std::move(dev)), timeout_(timeout)
  {
    check_mpi(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~mpi_communicator() override
  {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized == 0 && !failure_.failed()) { MPI_Comm_free(&comm_); }
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  comm_backend backend() const noexcept override { return comm_backend::mpi; }
  std::chrono::milliseconds timeout() const noexcept override { return timeout_; }

  void allreduce_many(std::span<const reduce_item> items, stream_view s, std::string_view what) override
  {
    check();
    struct job {
      std::byte* data;
      std::size_t count;
      dtype type;
      float scale;
    };
    std::vector<job> jobs;
    jobs.reserve(items.size());
    for (const reduce_item& it : items) {
      check_reduce_item(it, device_, "MPI", what, "the mpi backend reduces emulated-device buffers, use nccl for cuda");
      const std::size_t count = it.data.size() / size_of(it.type);
      TASKSWAP_EXPECTS(count <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
                       message("MPI allreduce of ", what, ": ", count, " elements exceeds MPI's int count"));
      const float scale = it.op == reduce_op::premul_sum ? static_cast<float>(it.factor)
                          : it.op == reduce_op::average  ? 1.0F / static_cast<float>(size_)
                                                         : 1.0F;
      jobs.push_back({it.data.data(), count, it.type, scale});
    }
    enqueue(s, [this, jobs = std::move(jobs), name = std::string(what)] {
      for (const job& j : jobs) {
        if (j.scale == 1.0F) { continue; }
        for (std::size_t i = 0; i < j.count; ++i) {
          narrow_element(j.data, j.type, i, widen_element(j.data, j.type, i) * j.scale);
        }
      }
      run("allreduce of " + name, jobs.size(), [&](std::size_t k, MPI_Request* r) {
        const job& j = jobs[k];
        const MPI_Datatype t = j.type == dtype::f32 ? MPI_FLOAT : MPI_UINT16_T;
        const MPI_Op o = j.type == dtype::f32 ? MPI_SUM : j.type == dtype::bf16 ? user_ops().bf16 : user_ops().f16;
        return MPI_Iallreduce(MPI_IN_PLACE, j.data, static_cast<int>(j.count), t, o, comm_, r);
      });
    });
  }

  void allreduce_counts(std::span<std::int64_t> values, stream_view s, std::string_view what) override
  {
    check();
    TASKSWAP_EXPECTS(&s.backend() == &device_.backend(),
                     message("MPI allreduce_counts of ", what, ": the stream is not on the communicator's device"));
    enqueue(s, [this, values, name = std::string(what)] {
      run("count allreduce of " + name, 1, [&](std::size_t, MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T, MPI_SUM, comm_,
                              r);
      });
    });
  }

  void broadcast(device_span data, int root, stream_view s, std::string_view what) override
  {
    check();
    check_broadcast(data, root, size_, device_, "MPI", what,
                    "the mpi backend broadcasts emulated-device buffers, use nccl for cuda");
    enqueue(s, [this, data, root, name = std::string(what)] {
      run("broadcast of " + name, (data.size() + broadcast_piece - 1) / broadcast_piece,
          [&](std::size_t k, MPI_Request* r) {
            const std::size_t n = std::min(broadcast_piece, data.size() - k * broadcast_piece);
            return MPI_Ibcast(data.data() + k * broadcast_piece, static_cast<int>(n), MPI_BYTE, root, comm_, r);
          });
    });
  }

  void barrier(stream_view s) override
  {
    check();
    enqueue(s, [this] { run("barrier", 1, [&](std::size_t, MPI_Request* r) { return MPI_Ibarrier(comm_, r); }); });
  }

  std::unique_ptr<communicator> split() override
  {
    check();
    // MPI_Comm_dup is a collective on this communicator: the queued ones must be done first, or
    // the ranks could see them in different orders.
    const auto begin = std::chrono::steady_clock::now();
    while (in_flight_.load() != 0) {
      if (std::chrono::steady_clock::now() - begin > timeout_) {
        throw timeout_error(message("taskswap: split(): the communicator's queued collectives did not finish within ",
                                    timeout_.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      check();
    }
    return std::make_unique<mpi_communicator>(device_, comm_, timeout_);
  }

  void check() const override { failure_.rethrow(); }
  bool failed() const noexcept override { return failure_.failed(); }

 private:
  // Queues a collective on `s`, counted in flight until it has run.
  template <typename Fn>
  void enqueue(stream_view s, Fn fn)
  {
    in_flight_.fetch_add(1);
    try {
      launch_host_func(s, [this, fn = std::move(fn)] {
        struct done {
          std::atomic<int>& n;
          ~done() { n.fetch_sub(1); }
        } guard{in_flight_};
        fn();
      });
    } catch (...) {
      in_flight_.fetch_sub(1);
      throw;
    }
  }

  // Starts `n` non-blocking collectives and polls them to the end, the timeout, or a failure.
  template <typename Start>
  void run(const std::string& what, std::size_t n, Start start)
  {
    failure_.rethrow();
    std::vector<MPI_Request> requests(n, MPI_REQUEST_NULL);
    for (std::size_t k = 0; k < n; ++k) {
      const int rc = [&] {
        const std::lock_guard lock(progress_mutex);
        return start(k, &requests[k]);
      }();
      if (rc != MPI_SUCCESS) {
        fail(comm_error(message("taskswap: MPI ", what, " failed to start: ", mpi_error_text(rc))));
      }
    }
    const auto begin = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      int rc = MPI_SUCCESS;
      {
        const std::lock_guard lock(progress_mutex);
        rc = MPI_Testall(static_cast<int>(n), requests.data(), &done, MPI_STATUSES_IGNORE);
      }
      if (rc != MPI_SUCCESS) {
        fail(comm_error(message("taskswap: MPI ", what, " failed on rank ", rank_, " of ", size_, ": ",
                                mpi_error_text(rc), "; the communicator is aborted")));
      }
      if (done != 0) { return; }
      if (std::chrono::steady_clock::now() - begin > timeout_) {
        fail(timeout_error(message("taskswap: MPI ", what, " did not finish within ", timeout_.count(), " ms on rank ",
                                   rank_, " of ", size_,
                                   ": another rank died, stalled or issued a different collective; the communicator "
                                   "is aborted. Look for the first error on the other ranks; raise [comm] timeout only "
                                   "if a step legitimately takes longer")));
      }
      if (polls > 64) { std::this_thread::sleep_for(std::chrono::microseconds(polls > 4096 ? 500 : 20)); }
    }
  }

  template <typename E>
  [[noreturn]] void fail(E e)
  {
    any_failed.store(true);
    if (failure_.fail(std::make_exception_ptr(e))) {
      // Work queued behind this collective (updates from gradients that never arrived, their
      // write-backs) must not take effect.
      device_.backend().abandon_work(std::make_exception_ptr(e));
    }
    failure_.rethrow();
    throw e;  // not reached: rethrow throws the first failure
  }

  device device_;
  std::chrono::milliseconds timeout_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  comm_failure failure_;
  std::atomic<int> in_flight_{0};
};

}  // namespace
}  // namespace detail

std::shared_ptr<communicator> make_mpi_communicator(const device& dev, std::chrono::milliseconds timeout)
{
  if (dev.kind() != backend_kind::emulated) {
    throw config_error(detail::message("taskswap: the mpi communicator reduces emulated-device buffers, and ",
                                       dev.name(), " is a cuda device; set [comm] backend = \"nccl\""));
  }
  TASKSWAP_EXPECTS(timeout.count() > 0,
                   detail::message("communicator timeout ", timeout.count(), " ms; give a positive timeout"));
  detail::ensure_mpi();
  return std::make_shared<detail::mpi_communicator>(dev, MPI_COMM_WORLD, timeout);
}

}  // namespace taskswap
