// SPDX-License-Identifier: Apache-2.0
#pragma once

// The active-gradient reducer: the runtime's partner when the ranks train together.
//
// - At construction the ranks compare a digest of their units (names, tensor shapes, dtypes) and
//   refuse to start when they differ.
// - When steps are planned, each rank's units per step are summed over the ranks (one small
//   collective per planned window, on a channel of its own so it never queues behind gradients):
//   a unit's count is the number of ranks that train it in that step.
// - A step's active units (count > 0) are reduced in one order, the same on every rank (highest
//   unit id first: the order backward reaches them when the trunk is registered before the
//   heads), packed into buckets (a small first one, then up to the cap). A bucket is launched on
//   the comm stream once all its units are ready and the bucket before it was launched; each
//   unit's gradient is pre-multiplied by 1 / its count (or 1 / world size) and summed.
// The runtime owns the units' memory and their updates; the reducer only orders and launches.

#include <taskswap/comm.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace taskswap::detail {

/// What the reducer knows of a unit.
struct reducer_unit {
  std::string name;
  std::size_t grad_bytes = 0;
  dtype grad = dtype::f32;
  std::uint64_t digest = 0;  // of its name, tensor shapes and dtypes
  std::size_t state_bytes = 0;  // its state tensors: broadcast from rank 0 after its reduction
};

/// A planned step as the ranks agreed it.
struct step_agreement {
  std::vector<std::uint32_t> order;  // active units, in reduction order
  std::vector<std::int64_t> counts;  // contributors of each, in the same order
  std::vector<std::size_t> bucket_end;  // bucket b is order[bucket_end[b-1] .. bucket_end[b])
  std::vector<int>
    state_root;  // per unit in order: the lowest rank that trained it, whose state tensors every rank takes
};

class reducer {
 public:
  /// Collective: compares the ranks' unit digests (throws config_error naming the ranks that differ).
  reducer(const device& dev, std::shared_ptr<communicator> comm, const comm_options& options,
          std::vector<reducer_unit> units);
  ~reducer();
  reducer(const reducer&) = delete;
  reducer& operator=(const reducer&) = delete;
  reducer(reducer&&) = delete;
  reducer& operator=(reducer&&) = delete;

  [[nodiscard]] communicator& comm() const noexcept { return *comm_; }

  /// Collective: agrees on the given steps' units (`local[k]`: the units this rank trains in step
  /// k, each once). Blocks until the small collective is done (within the timeout).
  [[nodiscard]] std::vector<step_agreement> agree(std::span<const std::vector<std::uint32_t>> local,
                                                  std::uint64_t first_step);

  /// Starts reducing a step.
  void begin(const step_agreement& step, std::uint64_t step_number);
  /// Whether `u` is active in the current step.
  [[nodiscard]] bool active(std::uint32_t u) const noexcept { return u < where_.size() && where_[u] >= 0; }
  /// `u`'s gradient slab (and its state tensors, `state`: empty when it has none) is complete once
  /// `ready` (recorded) has; launches what became launchable and returns the units whose
  /// reduction was enqueued by this call. A unit's state tensors are broadcast right after its
  /// bucket's allreduce, in the same order on every rank, from the lowest rank that trained it in
  /// the step (rank 0 with reduce = "every_unit").
  std::vector<std::uint32_t> ready(std::uint32_t u, device_span grads, const event& ready, device_span state = {});
  /// Whether `u` is marked ready in the current step.
  [[nodiscard]] bool is_ready(std::uint32_t u) const noexcept;
  /// The event after `u`'s reduction, once its bucket was launched; nullptr before.
  [[nodiscard]] const event* reduced(std::uint32_t u) const noexcept;
  /// Units of the current step not yet marked ready.
  [[nodiscard]] std::vector<std::uint32_t> not_ready() const;
  /// Ends the step; every bucket must have been launched.
  void end();

  /// Collective: sums `values` over the ranks in place on the agreement's channel; blocks until
  /// done (within the timeout). For the runtime's own agreements (checkpoints).
  void sum(std::span<std::int64_t> values, std::string_view what);
  /// Collective, at step boundaries, called the same number of times on every rank. Every
  /// `stop_period`-th call enqueues this rank's stop code (0: none) on a channel of its own without
  /// waiting, and returns what the previous such vote agreed (the code of the lowest rank that
  /// gave one, or 0); the calls between return 0 at once. A vote has a whole period to finish, so
  /// a collective that is slow to progress (MPI polling on a loaded host) is not waited for, and
  /// a request is acted on within 2 * stop_period calls. 16: measured on the sample at 2 ranks
  /// (docs/reliability.md), a vote every 4 steps slowed the step by about 5 % on a 2-core host
  /// (the MPI progress thread's polling), every 16 by nothing measurable. The channel is a split
  /// of the agreement's made at construction: a split is a collective without a timeout, so it is
  /// made while every rank is known to be there, not at the first vote.
  static constexpr std::uint64_t stop_period = 16;
  int stop_vote(int local);
  [[nodiscard]] int rank() const noexcept { return comm_->rank(); }
  [[nodiscard]] int world() const noexcept { return comm_->size(); }

  /// Bytes this step reduces, and the bytes a reduce-everything reducer would move.
  [[nodiscard]] std::size_t step_bytes() const noexcept { return step_bytes_; }
  [[nodiscard]] std::size_t all_bytes() const noexcept { return all_bytes_; }

 private:
  void check_digests();
  void launch_ready_buckets(std::vector<std::uint32_t>& launched);
  /// Waits (within the timeout) for `done`, recorded after a collective of `channel` on `s`.
  void wait_channel(const communicator& channel, stream& s, const event& done, std::string_view what);

  device device_;
  std::shared_ptr<communicator> comm_;
  std::unique_ptr<communicator> control_;  // the agreement's channel
  comm_options options_;
  std::vector<reducer_unit> units_;
  // What queued collectives write is declared before the streams, so it outlives them (a
  // stream's destruction lets its queued work finish).
  std::vector<std::int64_t> counts_;  // the agreement's buffer
  std::vector<std::uint32_t> state_units_;  // the units with state tensors, in index order
  std::vector<std::int64_t> sum_buffer_;  // sum()'s buffer
  // The stop votes: two slots of one int64 per rank (the previous vote's and this one's) in pinned
  // memory: a device-to-host copy into pageable memory would make the host wait for the vote.
  pinned_buffer stop_slots_;
  std::unique_ptr<communicator> stop_;
  stream stream_;  // gradients
  stream control_stream_;  // agreements
  stream stop_stream_;  // stop votes
  event control_done_;
  std::array<event, 2> stop_done_;
  std::uint64_t stop_calls_ = 0;
  [[nodiscard]] std::span<std::int64_t> stop_slot(std::size_t i) noexcept;
  std::size_t all_bytes_ = 0;

  // The current step
  const step_agreement* step_ = nullptr;
  std::uint64_t step_number_ = 0;
  std::vector<std::int32_t> where_;  // unit -> index in step_->order, or -1
  std::vector<device_span> slabs_;  // by index in order
  std::vector<device_span> states_;  // the state tensors of each, by index in order
  std::vector<const event*> ready_events_;
  std::vector<bool> ready_;
  std::size_t next_bucket_ = 0;
  std::vector<event> bucket_done_;
  std::size_t step_bytes_ = 0;
};

/// The buckets of a step's reduced units, in reduction order, of `grad_bytes` each: the first at
/// most 1 MiB (or `cap` where smaller), then up to `cap`; a unit larger than its bucket's cap goes
/// alone. Returns each bucket's end in `grad_bytes` (step_agreement::bucket_end). Every rank packs
/// the agreed units with it; the plan check uses it, and bucket_reach where only this rank's units
/// are known.
[[nodiscard]] std::vector<std::size_t> pack_buckets(std::span<const std::size_t> grad_bytes, std::size_t cap);

/// Before the ranks agree, where each of this rank's reduced units' bucket ends at the latest
/// (an index into `grad_bytes`, this rank's units in reduction order): other ranks' units, which
/// may join the order anywhere, only move bucket boundaries earlier. A unit's bucket holds what
/// follows it within `cap` bytes, itself included (or itself alone).
[[nodiscard]] std::vector<std::size_t> bucket_reach(std::span<const std::size_t> grad_bytes, std::size_t cap);

/// FNV-1a over the bytes of `text` (folded into `h`).
[[nodiscard]] std::uint64_t fnv1a(std::uint64_t h, std::string_view text) noexcept;

}  // namespace taskswap::detail
