// SPDX-License-Identifier: Apache-2.0
#include "device/emulated/emulated_backend.hpp"

#include "device/message.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <new>
#include <thread>

#include <cerrno>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

#if defined(__linux__)
#include <pthread.h>
#include <sys/prctl.h>
#endif

namespace taskswap::detail {

namespace {

constexpr std::align_val_t device_alignment{256};
constexpr std::align_val_t host_page{4096};

std::atomic<int> next_emulated_index{0};

// The state of an event: each record() starts a generation; waits name the generation that was
// current when they were issued, so a later re-record does not release an earlier wait.
struct emulated_event {
  explicit emulated_event(bool with_timing) : timing(with_timing) {}

  std::uint64_t record()
  {
    const std::lock_guard lock(mutex);
    pending.insert(++recorded);
    return recorded;
  }

  std::uint64_t current() const
  {
    const std::lock_guard lock(mutex);
    return recorded;
  }

  void complete(std::uint64_t generation)
  {
    {
      const std::lock_guard lock(mutex);
      pending.erase(generation);
      if (timing && generation >= stamped_generation) {
        stamped_generation = generation;
        stamp = std::chrono::steady_clock::now();
      }
    }
    completed.notify_all();
  }

  bool done(std::uint64_t generation) const { return !pending.contains(generation); }

  void wait(std::uint64_t generation) const
  {
    std::unique_lock lock(mutex);
    completed.wait(lock, [&] { return done(generation); });
  }

  bool wait_for(std::uint64_t generation, std::chrono::nanoseconds timeout) const
  {
    std::unique_lock lock(mutex);
    return completed.wait_for(lock, timeout, [&] { return done(generation); });
  }

  const bool timing;
  mutable std::mutex mutex;
  mutable std::condition_variable completed;
  std::uint64_t recorded = 0;
  std::set<std::uint64_t> pending;
  std::uint64_t stamped_generation = 0;
  std::chrono::steady_clock::time_point stamp{};
};

// Events may be destroyed while records or waits on them are still queued (as in CUDA), so the
// queued operations share ownership of the state; the handle owns one reference.
using event_ref = std::shared_ptr<emulated_event>;

event_ref& event_of(void* e) { return *static_cast<event_ref*>(e); }

}  // namespace

// How long a host thread waiting for a stream, and a stream's worker that ran out of work, poll
// before they sleep. A trainer that computes on the host (torch on the CPU) waits for its stream
// at every step: without the polls each wait costs two thread wake-ups, about 70 us on a small
// VM, more than the step's own work (measured with bench/python/torch_layer_overhead.py: 20 us
// of worker poll is too short for the gap between one step's end and the next one's acquires).
constexpr std::chrono::microseconds host_poll{50};
constexpr std::chrono::microseconds worker_poll{50};

// A stream: a worker thread running its operations in the order they were pushed; or, host
// synchronous, the pushing thread running each one as it pushes it (stream_options).
class emulated_queue {
 public:
  explicit emulated_queue(bool host_synchronous) : host_synchronous_(host_synchronous)
  {
    if (!host_synchronous_) {
      worker_ = std::thread([this] { run(); });
    }
  }

  ~emulated_queue()
  {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_one();
    if (worker_.joinable()) { worker_.join(); }  // the worker drains the queue before it exits
  }

  emulated_queue(const emulated_queue&) = delete;
  emulated_queue& operator=(const emulated_queue&) = delete;
  emulated_queue(emulated_queue&&) = delete;
  emulated_queue& operator=(emulated_queue&&) = delete;

  void push(std::function<void()> op)
  {
    if (host_synchronous_) {
      const std::lock_guard lock(mutex_);  // one operation at a time, in push order
      ++enqueued_;
      pushed_.store(enqueued_, std::memory_order_release);
      op();  // operations never throw: host functions are wrapped by run_host_func
      ++completed_;
      done_.store(completed_, std::memory_order_release);
      return;
    }
    bool wake = false;
    {
      const std::lock_guard lock(mutex_);
      ops_.push_back(std::move(op));
      ++enqueued_;
      pushed_.store(enqueued_, std::memory_order_release);
      wake = waiting_;
    }
    // A busy worker takes the next operation without a wake-up (a system call saved per push).
    if (wake) { work_.notify_one(); }
  }

  void synchronize()
  {
    const std::uint64_t target = pushed_.load(std::memory_order_acquire);
    if (poll([&] { return done_.load(std::memory_order_acquire) >= target; }, host_poll)) { return; }
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return completed_ >= target; });
  }

  bool query()
  {
    const std::lock_guard lock(mutex_);
    return completed_ == enqueued_;
  }

 private:
  void run()
  {
#if defined(__linux__)
    // Linux lets a sleeping thread oversleep by its timer slack (50 us by default); modelled
    // copies end with a sleep, so the slack would show up as a slower link.
    static_cast<void>(prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL));
    static_cast<void>(pthread_setname_np(pthread_self(), "taskswap-stream"));
#endif
    std::unique_lock lock(mutex_);
    for (;;) {
      if (ops_.empty() && !stopping_) {
        const std::uint64_t seen = enqueued_;
        lock.unlock();
        poll([&] { return pushed_.load(std::memory_order_acquire) != seen; }, worker_poll);
        lock.lock();
      }
      waiting_ = true;
      work_.wait(lock, [&] { return stopping_ || !ops_.empty(); });
      waiting_ = false;
      if (ops_.empty()) { return; }  // stopping, and nothing left to do
      auto op = std::move(ops_.front());
      ops_.pop_front();
      lock.unlock();
      op();  // operations never throw: host functions are wrapped by run_host_func
      op = nullptr;
      lock.lock();
      ++completed_;
      done_.store(completed_, std::memory_order_release);
      idle_.notify_all();
    }
  }

  // Polls `ready` for up to `limit`; true if it turned true.
  template <typename Ready>
  static bool poll(Ready ready, std::chrono::microseconds limit)
  {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!ready()) {
      if (std::chrono::steady_clock::now() >= until) { return false; }
      std::this_thread::yield();
    }
    return true;
  }

  std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> ops_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  std::atomic<std::uint64_t> pushed_{0};  // enqueued_ and completed_, readable without the mutex
  std::atomic<std::uint64_t> done_{0};
  bool stopping_ = false;
  bool waiting_ = false;  // the worker sleeps on work_
  bool host_synchronous_ = false;
  std::thread worker_;  // last: starts once the members above exist (none when host synchronous)
};

namespace {
emulated_queue& queue_of(void* s) { return *static_cast<emulated_queue*>(s); }
}  // namespace

namespace {

// The options as the device runs them: time_scale applied to the link and the call costs.
emulated_options at_scale(emulated_options o)
{
  const double s = o.time_scale;
  o.link.bytes_per_second /= s;
  o.link.latency_seconds *= s;
  for (vm_call_cost* c :
       {&o.vm_costs.map, &o.vm_costs.access, &o.vm_costs.unmap, &o.vm_costs.create, &o.vm_costs.release}) {
    c->per_call_seconds *= s;
    c->per_mib_seconds *= s;
  }
  return o;
}

}  // namespace

emulated_backend::emulated_backend(const emulated_options& options, const emulated_faults& faults)
    : options_(at_scale(options)), faults_(faults), index_(next_emulated_index.fetch_add(1))
{}

bool emulated_backend::busy()
{
  const auto now = std::chrono::steady_clock::now();
  for (link_channel* c : {&host_to_device_, &device_to_host_}) {
    const std::lock_guard lock(c->mutex);
    if (c->free_at > now) { return true; }
  }
  const std::lock_guard lock(queues_mutex_);
  return std::any_of(queues_.begin(), queues_.end(), [](emulated_queue* q) { return !q->query(); });
}

double emulated_backend::cost(const vm_call_cost& c, std::size_t calls, std::size_t bytes)
{
  if (c.per_call_seconds <= 0 && c.per_mib_seconds <= 0) { return 0; }
  const double seconds =
    static_cast<double>(calls) * c.per_call_seconds + static_cast<double>(bytes) / double(1 << 20) * c.per_mib_seconds;
  return options_.vm_costs.busy_factor > 1.0 && busy() ? seconds * options_.vm_costs.busy_factor : seconds;
}

// The calling thread's call takes `seconds` in all, its own work since `started` (backing memory,
// page tables) among them, as the driver's measured time includes its own: the rest is slept. A
// sleep overshoots by the thread's timer slack; what it overslept is owed back by the thread's next
// charges. Work past the model's time is not owed back.
void emulated_backend::charge(double seconds, std::chrono::steady_clock::time_point started)
{
  if (seconds <= 0) { return; }
  thread_local double owed = 0;
  const auto now = std::chrono::steady_clock::now();
  owed += std::max(0.0, seconds - std::chrono::duration<double>(now - started).count());
  if (owed <= 0) { return; }
  std::this_thread::sleep_for(std::chrono::duration<double>(owed));
  owed -= std::chrono::duration<double>(std::chrono::steady_clock::now() - now).count();
}

void emulated_backend::fault(std::exception_ptr why) noexcept
{
  const std::lock_guard lock(fault_mutex_);
  if (fault_) { return; }  // the first failure is the one every call reports
  fault_ = std::move(why);
  faulted_.store(true, std::memory_order_release);
}

void emulated_backend::abandon_work(const std::exception_ptr& why) noexcept { fault(why); }

void emulated_backend::check_fault() const
{
  if (!faulted()) { return; }
  const std::lock_guard lock(fault_mutex_);
  std::rethrow_exception(fault_);
}

emulated_backend::~emulated_backend() = default;

std::string emulated_backend::name() const { return message("emulated:", index_); }

memory_info emulated_backend::memory() const
{
  const std::lock_guard lock(memory_mutex_);
  return {options_.memory_bytes - used_bytes_, options_.memory_bytes};
}

void emulated_backend::synchronize()
{
  {
    const std::lock_guard lock(queues_mutex_);
    for (auto* queue : queues_) { queue->synchronize(); }
  }
  check_fault();
}

void emulated_backend::take_memory(std::size_t bytes)
{
  check_fault();
  if (faults_.fail_allocation != 0 && allocations_.fetch_add(1) + 1 == faults_.fail_allocation) {
    throw out_of_memory(message("emulated:", index_, ": allocation ", faults_.fail_allocation, " of ",
                                bytes_text(bytes), " failed (an injected fault)"),
                        bytes, 0, options_.memory_bytes);
  }
  const std::lock_guard lock(memory_mutex_);
  const std::size_t available = options_.memory_bytes - used_bytes_;
  if (bytes > available) {
    throw out_of_memory(message("emulated:", index_, ": cannot allocate ", bytes_text(bytes), " of device memory; ",
                                bytes_text(available), " free of ", bytes_text(options_.memory_bytes),
                                "; free buffers first or give the emulated device more memory_bytes"),
                        bytes, available, options_.memory_bytes);
  }
  used_bytes_ += bytes;
}

void emulated_backend::give_memory(std::size_t bytes) noexcept
{
  const std::lock_guard lock(memory_mutex_);
  used_bytes_ -= bytes;
}

std::byte* emulated_backend::allocate(std::size_t bytes)
{
  take_memory(bytes);
  try {
    auto* p = static_cast<std::byte*>(::operator new(bytes, device_alignment));
    std::memset(p, 0, bytes);  // back every page now, as cudaMalloc does: no faults inside copies
    return p;
  } catch (const std::bad_alloc&) {
    give_memory(bytes);
    throw out_of_memory(
      message("emulated:", index_, ": the host could not provide ", bytes_text(bytes), " to stand for device memory"),
      bytes, 0, options_.memory_bytes);
  }
}

void emulated_backend::deallocate(std::byte* p, std::size_t bytes) noexcept
{
  // As cudaFree: wait for queued work that may still touch the memory.
  try {
    synchronize();
  } catch (...) {  // synchronize only locks and waits; nothing it does is expected to throw
  }
  ::operator delete(p, device_alignment);
  give_memory(bytes);
}

std::byte* emulated_backend::allocate_pinned(std::size_t bytes)
{
  try {
    auto* p = static_cast<std::byte*>(::operator new(bytes, host_page));
    std::memset(p, 0, bytes);  // fault the pages in now, as pinning does
    return p;
  } catch (const std::bad_alloc&) {
    throw out_of_memory(
      message("emulated:", index_, ": the host could not provide ", bytes_text(bytes), " of pinned memory"), bytes, 0,
      0);
  }
}

void emulated_backend::deallocate_pinned(std::byte* p, std::size_t /*bytes*/) noexcept
{
  try {
    synchronize();  // as cudaFreeHost
  } catch (...) {}
  ::operator delete(p, host_page);
}

void emulated_backend::register_host(void* p, std::size_t bytes)
{
  if (::mlock(p, bytes) != 0) {
    const int code = errno;
    throw out_of_memory(
      message("emulated:", index_, ": cannot lock ", bytes_text(bytes), " of host memory (mlock: ", std::strerror(code),
              "); raise the locked-memory limit (ulimit -l) or do not ask for "
              "locked pages on the emulated backend"),
      bytes, 0, 0);
  }
}

void emulated_backend::unregister_host(void* p, std::size_t bytes) noexcept { static_cast<void>(::munlock(p, bytes)); }

void* emulated_backend::create_stream(int /*priority*/, bool host_synchronous)
{
  auto queue = std::make_unique<emulated_queue>(host_synchronous);
  const std::lock_guard lock(queues_mutex_);
  queues_.insert(queue.get());
  return queue.release();
}

void* emulated_backend::adopt_stream(std::uintptr_t handle)
{
  throw invalid_argument(message("external_stream(", handle, ") on ", name(),
                                 ": an external stream handle is a CUDA stream, and the emulated device runs its own "
                                 "queues; use a taskswap::stream of the emulated device instead"));
}

void emulated_backend::destroy_stream(void* s) noexcept
{
  auto* queue = &queue_of(s);
  {
    const std::lock_guard lock(queues_mutex_);
    queues_.erase(queue);
  }
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): the handle owns the queue; its destructor finishes the queued work
  delete queue;
}

void emulated_backend::synchronize_stream(void* s)
{
  queue_of(s).synchronize();
  check_fault();
}

bool emulated_backend::query_stream(void* s)
{
  check_fault();
  return queue_of(s).query();
}

void emulated_backend::transfer(link_channel& channel, void* dst, const void* src, std::size_t bytes)
{
  if (!options_.link.enabled()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  using std::chrono::steady_clock;
  const auto modelled = std::chrono::duration_cast<steady_clock::duration>(std::chrono::duration<double>(
    options_.link.latency_seconds + static_cast<double>(bytes) / options_.link.bytes_per_second));
  steady_clock::time_point end;
  {
    const std::lock_guard lock(channel.mutex);
    const auto start = std::max(steady_clock::now(), channel.free_at);
    end = start + modelled;
    channel.free_at = end;
  }
  std::memcpy(dst, src, bytes);
  std::this_thread::sleep_until(end);
}

void emulated_backend::copy_async(void* dst, const void* src, std::size_t bytes, copy_direction direction, void* s)
{
  check_fault();
  link_channel* channel = nullptr;
  if (direction == copy_direction::host_to_device) { channel = &host_to_device_; }
  if (direction == copy_direction::device_to_host) { channel = &device_to_host_; }
  if (channel == nullptr || (faults_.fail_copy == 0 && faults_.stall_copy == 0)) {  // no fault to inject
    queue_of(s).push([this, channel, dst, src, bytes] {
      if (faulted()) { return; }  // work after a failure is not done
      if (channel != nullptr) {
        transfer(*channel, dst, src, bytes);
      } else {
        std::memcpy(dst, src, bytes);  // device memory bandwidth is not modelled
      }
    });
    return;
  }
  const std::uint64_t number = copies_.fetch_add(1) + 1;
  const bool fails = number == faults_.fail_copy;
  const bool stalls = number == faults_.stall_copy;
  const char* way = direction == copy_direction::host_to_device ? "host→device" : "device→host";
  queue_of(s).push([this, channel, dst, src, bytes, fails, stalls, number, way] {
    if (faulted()) { return; }
    if (stalls) {
      std::this_thread::sleep_for(faults_.stall);
      if (faulted()) { return; }  // abandoned while it stalled
    }
    if (fails) {
      fault(std::make_exception_ptr(
        device_error(message("emulated:", index_, ": copy ", number, " (", way, ", ", bytes_text(bytes),
                             ") failed (an injected fault); the device is unusable, and work "
                             "queued after the copy was not done"))));
      return;
    }
    transfer(*channel, dst, src, bytes);
  });
}

void emulated_backend::fill_async(void* dst, std::byte value, std::size_t bytes, void* s)
{
  check_fault();
  queue_of(s).push([this, dst, value, bytes] {
    if (!faulted()) { std::memset(dst, std::to_integer<int>(value), bytes); }
  });
}

void emulated_backend::launch_host_func(void* s, std::function<void()> fn)
{
  check_fault();
  queue_of(s).push([this, slot = error_slot(s), fn = std::move(fn)] {
    if (!faulted()) { run_host_func(*slot, fn); }
  });
}

void* emulated_backend::create_event(bool timing)
{
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): owned by the handle
  return new event_ref(std::make_shared<emulated_event>(timing));
}

void emulated_backend::destroy_event(void* e) noexcept
{
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): queued operations keep their own references
  delete &event_of(e);
}

void emulated_backend::record_event(void* e, void* s)
{
  check_fault();
  event_ref state = event_of(e);
  const std::uint64_t generation = state->record();
  queue_of(s).push([state = std::move(state), generation] { state->complete(generation); });
}

void emulated_backend::wait_event(void* s, void* e)
{
  check_fault();
  event_ref state = event_of(e);
  const std::uint64_t generation = state->current();
  if (generation == 0) { return; }  // never recorded: nothing to wait for
  queue_of(s).push([state = std::move(state), generation] { state->wait(generation); });
}

void emulated_backend::synchronize_event(void* e)
{
  const auto& state = event_of(e);
  state->wait(state->current());
  check_fault();
}

bool emulated_backend::synchronize_event_for(void* e, std::chrono::nanoseconds timeout)
{
  const auto& state = event_of(e);
  const bool done = state->wait_for(state->current(), timeout);
  check_fault();
  return done;
}

bool emulated_backend::query_event(void* e)
{
  check_fault();
  const auto& state = event_of(e);
  const std::lock_guard lock(state->mutex);
  return state->done(state->recorded);
}

double emulated_backend::elapsed_ms(void* start, void* end)
{
  auto stamp_of = [](const event_ref& state, const char* which) {
    const std::lock_guard lock(state->mutex);
    if (state->recorded == 0 || !state->done(state->recorded)) {
      throw invalid_argument(message("elapsed_ms: the ", which, " event has not completed; synchronize it first"));
    }
    return state->stamp;
  };
  const auto t0 = stamp_of(event_of(start), "start");
  const auto t1 = stamp_of(event_of(end), "end");
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

}  // namespace taskswap::detail
