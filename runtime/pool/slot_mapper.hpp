// SPDX-License-Identifier: Apache-2.0
#pragma once

// The device pool's mapping thread: it makes the driver's virtual-memory calls (create, release,
// map, unmap of physical handles) that the pool decides, in the order it decides them, so that
// none of them runs on the trainer's thread (Note [Mapping off the trainer's thread]). The pool
// keeps every decision (which handle goes where) on the caller's thread; the thread only carries
// them out. A batch of calls is a job; the pool learns that a job is done from its ticket.
//
// A job may carry a fence: an event after the previous users of the addresses it unmaps. The
// thread waits for it, at most `timeout`, before the calls; a fence that does not complete in that
// time fails the job. A failed call fails its job and every later one: the pool's record of what
// is mapped no longer holds, and each later ready()/wait() throws the same error.
//
// A deferred job (unmaps only, no ticket) runs after the jobs queued before it: ahead of the other
// queued jobs once its fence has completed, or else just before the first later job that needs it
// (one that maps, unmaps or frees addresses it unmaps, or releases a handle mapped there). What is
// still deferred at stop() is left to release_all().

#include <taskswap/device.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace taskswap::detail {

class backend;

class slot_mapper {
 public:
  using ticket = std::uint64_t;  // 0: nothing to wait for

  /// One driver call. Handles are named by the pool's extent ids; the thread keeps the handle of
  /// each id from its create to its release.
  struct call {
    enum class kind : std::uint8_t { create, release, map, unmap, free_addresses };
    kind what = kind::map;
    std::uint32_t extent = 0;  // create, release, map
    std::byte* address = nullptr;  // map, unmap, free_addresses
    std::size_t granules = 0;  // create, map, unmap; free_addresses: bytes
  };
  struct job {
    std::optional<event> fence;  // recorded after the users of what the job unmaps or releases
    std::string fence_users;  // who they are, for the timeout's message
    std::vector<call> calls;
  };

  slot_mapper(const device& dev, std::chrono::milliseconds timeout);
  /// Lets the queued jobs finish and stops the thread.
  ~slot_mapper();
  slot_mapper(const slot_mapper&) = delete;
  slot_mapper& operator=(const slot_mapper&) = delete;
  slot_mapper(slot_mapper&&) = delete;
  slot_mapper& operator=(slot_mapper&&) = delete;

  /// Queues `j`; its ticket. A job with no calls is done at once (ticket 0).
  [[nodiscard]] ticket submit(job j);
  /// Queues `j`, whose calls are unmaps, as a deferred job (above); nothing waits for it by ticket.
  void defer(job j);
  /// Whether the job is done. @throws the failure of this or an earlier job
  [[nodiscard]] bool ready(ticket t);
  /// Blocks until the job is done. @throws the failure of this or an earlier job
  void wait(ticket t);
  /// Blocks until every queued job but the deferred ones (left to release_all()) is done and stops
  /// the thread; what failed, if anything.
  [[nodiscard]] std::exception_ptr stop() noexcept;
  /// After stop(), with the device's work done: unmaps everything mapped and releases every handle,
  /// as the calls that succeeded left them (whatever the caller's record says after a failure);
  /// what went wrong, for the caller to report. Never throws.
  [[nodiscard]] std::vector<std::string> release_all() noexcept;
  /// Runs `j` on the calling thread, before the thread starts: the pool's construction.
  void run_here(const job& j);

 private:
  void run();
  /// Runs a deferred job whose fence has completed, if there is one (with the lock held on entry
  /// and on return); whether it ran one.
  bool run_deferred(std::unique_lock<std::mutex>& lock);
  /// Takes out of the deferred jobs those the job `j` of ticket `t` must follow, in their order.
  [[nodiscard]] std::vector<job> needed_by(const job& j, ticket t);
  /// Carries out `first`, then `j` (unless a failure came earlier); records what failed.
  void carry_out_all(std::vector<job> first, job j, std::unique_lock<std::mutex>& lock);
  void carry_out(const job& j);

  device dev_;
  std::chrono::milliseconds timeout_;
  // What the calls that succeeded did, the thread's alone while it runs: the handle of each
  // extent id (and its granules), and every mapping by its address (granules, extent id).
  std::vector<void*> handles_;
  std::vector<std::size_t> handle_granules_;
  std::map<std::byte*, std::pair<std::size_t, std::uint32_t>> mapped_;
  std::size_t granule_ = 0;
  std::mutex mutex_;
  std::condition_variable queued_;
  std::condition_variable finished_;
  std::deque<job> jobs_;
  struct deferred {
    ticket after = 0;  // the last job queued before it
    job j;
  };
  std::deque<deferred> deferred_;
  ticket submitted_ = 0;
  ticket done_ = 0;
  std::exception_ptr failure_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace taskswap::detail
