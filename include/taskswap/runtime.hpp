// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The runtime: units, residency policies, the plan, and the step protocol
/// (acquire → grads_ready → step → release, then end_step).

#include <taskswap/checkpoint.hpp>
#include <taskswap/comm.hpp>
#include <taskswap/device.hpp>
#include <taskswap/dtype.hpp>
#include <taskswap/optimizer.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace taskswap {

/// @brief Where a unit lives between uses.
enum class residency : std::uint8_t {
  pinned,  ///< always on the device (the trunk, typically)
  prefetch,  ///< brought in ahead of use as the plan and its lookahead allow
  on_demand,  ///< brought in at acquire
};

/// @brief Where a unit's AdamW step runs.
enum class optimizer_placement : std::uint8_t {
  device,  ///< master, m and v travel with the unit; the AdamW kernel runs on the device
  host,  ///< only parameters and gradients travel; the CPU AdamW updates the home copy
};

/// @brief How a step uses a unit it acquires, chosen per acquisition in the plan.
enum class unit_use : std::uint8_t {
  train,  ///< forward and backward: a gradient slab, a reduction, an update
  frozen,  ///< forward only: the parameters alone on the device; never reduced, stepped or written back
  /// An activation block's write (unit_spec::activation): its slab comes onto the device with no
  /// copy in, the step writes all of it, and its release sends it home on the runtime's copy
  /// stream after the work on the release's stream. A later frozen use brings it back, prefetched
  /// in the plan's order; that use's release frees its device room when no frozen use follows.
  stash,
};

[[nodiscard]] std::string_view to_string(residency r) noexcept;
[[nodiscard]] std::string_view to_string(optimizer_placement p) noexcept;
[[nodiscard]] std::string_view to_string(unit_use u) noexcept;

/// @brief A unit's residency policy, optimizer placement and hyperparameters (torch's param
/// groups: a unit is in the group its policy describes).
struct unit_policy {
  taskswap::residency residency = taskswap::residency::prefetch;
  int lookahead = 2;  ///< prefetch: steps ahead of the current one (0: only within the current step)
  optimizer_placement optimizer = optimizer_placement::device;
  double lr_scale = 1.0;  ///< the unit's learning rate is the optimizer's lr times this (> 0)
  /// The unit's weight decay (>= 0); none: the optimizer's. A unit with its own is not affected by
  /// the weight decay set_optimizer() sets (its lr still scales with the optimizer's).
  std::optional<double> weight_decay{};
  /// The home tier that keeps its home copy: "host" (the pinned, NUMA-local arena) or "disk" (a
  /// unit file under [storage] path, behind the host cache).
  std::string home = "host";
};

/// @brief A policy rule: applies to the units whose name matches the glob (fnmatch syntax);
/// rules are applied in order over the defaults, so later rules win.
struct unit_rule {
  std::string match;
  std::optional<taskswap::residency> residency;
  std::optional<int> lookahead;
  std::optional<optimizer_placement> optimizer;
  std::string origin;  ///< where the rule came from ("file:line"), for error messages
  std::optional<double> lr_scale{};  ///< see unit_policy
  std::optional<double> weight_decay{};  ///< see unit_policy
  std::optional<std::string> home{};  ///< see unit_policy
};

/// @brief Which device the runtime uses, and how much of it.
struct device_options {
  backend_kind backend = backend_kind::cuda;
  int index = 0;  ///< cuda: the device ordinal
  std::size_t budget = 0;  ///< device bytes the runtime may hold (required)
  emulated_options emulated{.memory_bytes = 0, .link = {}};  ///< emulated: memory (0: the budget), link model
};

/// @brief The host side: where the home copies live and who runs the CPU AdamW.
struct host_options {
  int numa_node = -1;  ///< -1: the device's local node
  bool huge_pages = false;
  int optimizer_threads = 0;  ///< CPU AdamW threads; 0: the node's CPUs
};

/// @brief The disk home tier ([storage]): the homes of units with home = "disk" live in files on a
/// local drive, with pinned host memory caching them (docs/storage.md).
struct storage_options {
  std::filesystem::path path{};  ///< the directory of the unit files (made if missing)
  std::size_t host_cache = 0;  ///< pinned host bytes caching disk homes; at least the largest disk-homed unit
  unsigned queue_depth = 8;  ///< reads and writes in flight at once
  std::size_t block = std::size_t{1} << 20;  ///< bytes per request, a multiple of 4 KiB
  int lookahead = 4;  ///< steps ahead the plan's disk homes are read into the host cache
  /// A wait for the drive with no request answered this long fails the run with a storage_error
  /// naming the oldest request's file and unit (a drive that stopped answering), not a hang.
  std::chrono::milliseconds timeout{300'000};
  /// Fault injection, for tests (as emulated_faults): the unit files' `fail_request`-th block
  /// request (counted from 1; 0: none) fails with errno `fail_errno` (5: EIO; 28: ENOSPC), and the
  /// `short_request`-th reports none of its bytes done, as at a file's end (a short read, or a
  /// write the drive took none of).
  std::uint64_t fail_request = 0;
  int fail_errno = 5;
  std::uint64_t short_request = 0;
};

/// @brief Everything the TOML configuration holds (see load_config in config.hpp).
struct runtime_options {
  device_options device{};
  host_options host{};
  storage_options storage{};
  unit_policy defaults{};
  std::vector<unit_rule> units{};  ///< applied in order over `defaults`
  adamw_options optimizer{};
  comm_options comm{};
  bool measure_stall = true;  ///< time the compute stream's waits on swap-ins (events)
  bool trace = false;  ///< record spans for write_trace()
  /// How long flush(), save_checkpoint() and the destructor wait for the device before they give
  /// up with timeout_error (a stalled copy or trainer stream); the runtime then writes nothing home.
  std::chrono::milliseconds timeout{300'000};
  std::string source = "options";  ///< where these options came from, for error messages
  loss_scaler_options scaler{};  ///< [scaler]: dynamic loss scaling (off by default)
};

/// @brief A named tensor of a unit.
struct tensor_spec {
  std::string name;
  std::vector<std::size_t> shape;
  bool no_weight_decay = false;  ///< AdamW without weight decay (biases, norms), as torch's no-decay group
  /// A non-trainable state tensor (torch's buffers: a norm's running statistics). It lies in the
  /// parameter slab (compute dtype) after every trainable tensor, travels with the parameters and
  /// is written home with the unit's update, but is never updated, clipped or reduced: its
  /// gradient elements are ignored. With a communicator every rank takes rank 0's values when
  /// the unit's gradients are reduced (as DDP's broadcast_buffers), so replicas stay equal.
  /// Initialise it in home().params (with a compute dtype other than f32, the master is ignored).
  /// Write it in trained uses only; a frozen use reads it (as torch's eval mode does).
  bool state = false;
};

/// @brief What a trainer registers: a named set of tensors stored as one slab per kind.
struct unit_spec {
  std::string name;
  std::vector<tensor_spec> tensors;
  dtype compute = dtype::f32;  ///< parameters on the device; u8 (raw bytes) for a frozen unit only
  std::optional<dtype> grad{};  ///< gradients; default: the compute dtype
  std::optional<unit_policy> policy{};  ///< overrides the options' defaults and rules
  /// false: a unit that is never trained (a frozen base model). It has its parameter slab alone,
  /// at home and on the device: no gradients, master, m or v anywhere, no write-back, no
  /// reduction; its footprint, the plan check and the planner count its parameters. Every use
  /// is unit_use::frozen (a trained use is refused), and its placement does not matter.
  bool trainable = true;
  /// An activation block (implies trainable false): a step writes it in a unit_use::stash use
  /// and reads it back in frozen uses (the backward pass), the runtime moving it home and back
  /// on its copy streams as the plan says. Its home is scratch: not in checkpoints, not checked
  /// across ranks, and its contents are defined only between a stash and the next one.
  bool activation = false;
};

/// @brief A registered unit's handle.
struct unit_id {
  std::uint32_t value = 0;
  friend bool operator==(unit_id, unit_id) = default;
};

/// @brief A tensor's place in its unit's slabs.
struct tensor_info {
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t count = 0;  ///< elements
  std::size_t offset = 0;  ///< first element in the unit's slabs
  bool no_weight_decay = false;  ///< as the tensor_spec said: AdamW steps it without weight decay
  bool state = false;  ///< a non-trainable state tensor (see tensor_spec::state)
};

/// @brief A flat slab: `count` elements of `type` at `data`.
struct slab_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  std::size_t count = 0;
  [[nodiscard]] std::size_t bytes() const noexcept { return count * size_of(type); }
};

/// @brief One tensor of a unit on the device, valid while its unit is held.
struct tensor_view {
  device_span memory;  ///< its bytes: what copy_async and fill_async take
  dtype type = dtype::f32;
  std::span<const std::size_t> shape;  ///< as registered
  std::size_t count = 0;  ///< elements
  /// @brief Its first element as `T`: float for f32, std::uint16_t (the bits) for bf16 and f16,
  /// std::uint8_t for u8.
  /// A device address: dereference it in device code only (host code on the emulated device).
  /// @throws invalid_argument when `T` does not match the dtype
  template <typename T>
  [[nodiscard]] T* data() const
  {
    check_element(sizeof(T), std::is_floating_point_v<T>);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the tensor's elements
    return reinterpret_cast<T*>(memory.data());
  }

 private:
  void check_element(std::size_t size, bool floating) const;
};

/// @brief A unit on the device, valid from acquire until release.
struct unit_view {
  unit_id id{};
  std::span<const tensor_info> tensors;
  slab_view params;  ///< compute dtype
  slab_view grads;  ///< zero when the unit arrives and after each step; kernels accumulate into it.
    ///< Empty (null, 0 elements) when the unit is used frozen
  bool frozen = false;  ///< acquired with unit_use::frozen: read the parameters only
  /// @brief Device address of tensor `i`'s parameters.
  [[nodiscard]] void* param(std::size_t i) const;
  /// @brief Device address of tensor `i`'s gradients.
  /// @throws invalid_argument when the unit is used frozen (it has no gradients)
  [[nodiscard]] void* grad(std::size_t i) const;
  /// @brief Tensor `i`'s parameters: bytes, dtype and shape.
  /// @throws invalid_argument when `i` is not a tensor of the unit
  [[nodiscard]] tensor_view param_tensor(std::size_t i) const;
  /// @brief Tensor `i`'s gradients: bytes, dtype and shape.
  /// @throws invalid_argument when `i` is not a tensor of the unit, or the unit is used frozen
  [[nodiscard]] tensor_view grad_tensor(std::size_t i) const;
  detail::backend* owner = nullptr;  ///< the device's backend, whose memory the slabs are
};

/// @brief A unit's authoritative home copy in the pinned host arena. Current after
/// runtime::flush() until the unit is next acquired.
struct home_view {
  unit_id id{};
  std::span<const tensor_info> tensors;
  slab_view params;  ///< compute dtype
  slab_view master;  ///< f32; the same memory as params when the compute dtype is f32
  slab_view m;
  slab_view v;
  std::int64_t step = 0;  ///< AdamW steps taken
};

/// @brief One planned training step: the ordered acquisitions (and, where a unit is let go
/// before the step ends, its release), as the trainer will call them.
///
/// Each acquisition says how the step uses the unit. A frozen use (forward only) brings only the
/// parameters (no gradient slab in the budget, no zero-fill), is never reduced or stepped, and
/// leaves the unit clean; the next step may train it again. Freezing a unit for the rest of a run
/// is planning it frozen from then on.
class step_plan {
 public:
  struct entry {
    unit_id unit;
    bool acquire;
    unit_use use = unit_use::train;  ///< for an acquisition
  };
  step_plan() = default;
  /// @brief Acquisitions in this order, each trained and held until the end of the step.
  step_plan(std::initializer_list<unit_id> acquisitions);
  explicit step_plan(std::span<const unit_id> acquisitions);

  /// @brief Appends an acquisition, trained or frozen.
  step_plan& acquire(unit_id u, unit_use use = unit_use::train);
  /// @brief Appends a release (before the step's end) of a unit acquired earlier in the step.
  step_plan& release(unit_id u);

  [[nodiscard]] std::span<const entry> entries() const noexcept { return entries_; }

 private:
  std::vector<entry> entries_;
};

/// @brief What one unit costs, from its spec and placement alone (no device needed): what a
/// planner or a capacity estimate uses before a runtime exists.
struct unit_footprint {
  std::size_t device_bytes = 0;  ///< while resident (the budget it takes)
  std::size_t home_bytes = 0;  ///< its block in the pinned host arena
  std::size_t swap_in_bytes = 0;  ///< host→device per swap-in
  std::size_t write_back_bytes = 0;  ///< device→host per write-back (0 for host placement)
  std::size_t grad_bytes = 0;  ///< its gradient slab, tail padding included (the device memory
    ///< it takes; host placement: what is sent home each step)
  std::size_t reduce_bytes = 0;  ///< what one allreduce of its gradients moves, as step_stats
    ///< counts it: the tensors' elements and the gaps of < 64
    ///< elements between tensors (one contiguous range), no tail padding
  std::size_t param_bytes = 0;  ///< its parameter slab (host placement: uploaded after each CPU step)
  std::size_t frozen_device_bytes = 0;  ///< while used frozen (its parameter slab alone), when not
    ///< resident already; pinned units keep device_bytes
  std::size_t frozen_swap_in_bytes = 0;  ///< host→device per swap-in for a frozen use
};

/// @brief The footprint of `spec` under `placement`; the same layout the runtime uses.
/// @throws config_error for a unit without tensors or with an empty dimension
[[nodiscard]] unit_footprint footprint(const unit_spec& spec, optimizer_placement placement);

/// @brief The device bytes a runtime of `units` units takes of its budget, before granule
/// rounding, for guarded steps (loss scaling or clipping): the scaler's state, the square sums'
/// scratch and a step count per unit. 0 is not returned: call it only for guarded options.
[[nodiscard]] std::size_t step_guard_device_bytes(std::size_t units) noexcept;

/// @brief The budget that holds every one of `units` pinned under `options` (an all-resident
/// baseline), as the runtime places pinned units: their device bytes (each under its policy's
/// placement) packed at 256-byte offsets, in whole granules of the configured device, and the
/// guarded step's bytes in whole granules of their own where loss scaling or clipping is on.
/// @throws config_error as footprint(); device errors where the configured device cannot be made
[[nodiscard]] std::size_t all_pinned_budget(const runtime_options& options, std::span<const unit_spec> units);

/// @brief The policy the runtime gives `spec` under `options`: its own policy if it has one,
/// else the defaults with every matching [[units]] rule applied in order.
[[nodiscard]] unit_policy policy_for(const unit_spec& spec, const runtime_options& options);

/// @brief Whether a unit of policy `p` keeps its home behind the host cache (the "disk" tier):
/// its home() view lasts until the next call to the runtime, and the plan reads it [storage]
/// lookahead steps ahead.
/// @throws config_error for a home tier that does not exist, naming the tiers
[[nodiscard]] bool home_is_cached(const unit_policy& p);

/// @brief Where a unit is now.
enum class unit_state : std::uint8_t { home, resident, held };

/// @brief Transfers, hits and stalls of one step (or of all steps, in runtime_stats::total).
struct step_stats {
  std::uint64_t step = 0;
  std::size_t h2d_bytes = 0;
  std::size_t d2h_bytes = 0;
  std::size_t hits = 0;  ///< acquisitions whose unit was resident or on its way
  std::size_t misses = 0;  ///< acquisitions that had to start the swap-in
  std::size_t unplanned = 0;  ///< acquisitions the plan did not announce
  std::size_t frozen = 0;  ///< acquisitions used frozen
  std::size_t swap_ins = 0;
  std::size_t write_backs = 0;
  std::size_t evictions = 0;
  double stall_ms = 0;  ///< the compute stream's measured wait on swap-ins
  std::size_t peak_device_bytes = 0;
  std::size_t reduced_bytes = 0;  ///< gradient bytes allreduced (with a communicator)
  std::size_t reduce_all_bytes = 0;  ///< what reducing every unit, as DDP does, would have moved
};

/// @brief Per-unit residency figures.
struct unit_stats {
  std::string name;
  unit_state state = unit_state::home;
  bool dirty = false;
  std::size_t device_bytes = 0;
  std::size_t home_bytes = 0;
  std::size_t swap_ins = 0;
  std::size_t write_backs = 0;
  std::int64_t step = 0;
  unit_policy policy{};
};

/// @brief Cumulative figures, the recent steps, and each unit.
/// @brief The disk home tier's host cache since the runtime began (zeros without disk homes).
struct disk_stats {
  std::size_t host_cache_bytes = 0;  ///< the cache's capacity ([storage] host_cache)
  std::size_t cached_bytes = 0;  ///< disk homes in the cache now
  std::uint64_t hits = 0;  ///< a disk home wanted while cached
  std::uint64_t misses = 0;  ///< a disk home wanted while absent from the cache, or its read not done
  std::uint64_t evictions = 0;
  std::uint64_t written_back = 0;  ///< dirty blocks written to their files (evictions and flushes)
  std::uint64_t prefetches = 0;  ///< reads started ahead of use, as the plan says
  double wait_ms = 0;  ///< the trainer thread's waits for the drive (a read not done at use, a victim's write)
  std::uint64_t read_bytes = 0;
  std::uint64_t written_bytes = 0;
  std::uint64_t requests = 0;  ///< block requests sent to the drive, reads and writes, resends included
};

struct runtime_stats {
  step_stats total;
  std::vector<step_stats> steps;  ///< the most recent steps (up to 4096), oldest first
  std::vector<unit_stats> units;
  std::size_t budget = 0;
  std::size_t pinned_device_bytes = 0;  ///< held by pinned units
  std::size_t device_bytes_in_use = 0;
  std::size_t home_bytes = 0;  ///< slab bytes at home
  std::size_t host_bytes_pinned = 0;  ///< bytes page-locked for them
  std::size_t device_granule = 0;  ///< the device pool maps whole granules of this many bytes
  std::size_t device_rounding_bytes = 0;  ///< in use beyond what the resident slabs need: granule rounding
  disk_stats disk{};  ///< the disk home tier ([storage])
};

/// @brief The runtime: holds every unit's home copy in a pinned, NUMA-local arena and the
/// resident ones in a device pool of the budget; moves them on its own copy streams as the plan
/// says; runs AdamW where each unit's placement says.
///
/// One trainer thread calls the step protocol; the runtime is not thread-safe. No call of the
/// step protocol waits for the device (invariant 4); dependencies are events on the trainer's
/// stream and the runtime's copy streams.
class runtime {
 public:
  /// @brief Lays out every unit's slabs in one pinned arena of exactly their size, applies the
  /// policies and brings the pinned units onto the device.
  /// @throws config_error for a unit that can never fit next to the pinned units, a duplicate
  /// or empty name, a rule that matches no unit (with the rule's origin)
  /// @throws out_of_memory when the device cannot hold the budget
  runtime(const device& dev, const runtime_options& options, const std::vector<unit_spec>& units);
  /// @brief As above, reducing gradients over `comm` (nullptr: the communicator options.comm
  /// names, if any). Collective when there is a communicator: every rank constructs its runtime
  /// with the same units, which is checked (config_error naming the ranks that differ).
  ///
  /// With a communicator, every acquisition must be planned, and every rank calls plan() with
  /// the same number of steps at the same point: plan() agrees with the other ranks on each
  /// step's units (one small collective per call). A unit some rank trains in a step is updated
  /// on every rank: a rank that does not train it acquires it itself, contributes zero gradients
  /// and applies the same update, so replicas stay identical; a unit no rank trains is untouched.
  /// Gradients are averaged over the ranks that trained the unit (or the world size, [comm]
  /// average = "world"). step(u) waits (on the device) for u's reduction; release(u) of a
  /// unit not stepped steps it first, so that every rank applies the same updates.
  runtime(const device& dev, const runtime_options& options, const std::vector<unit_spec>& units,
          std::shared_ptr<communicator> comm);
  /// @brief Writes dirty units back and waits for the runtime's streams; never throws.
  ~runtime();
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;
  runtime(runtime&&) noexcept;
  runtime& operator=(runtime&&) noexcept;

  /// @throws invalid_argument when no unit has that name
  [[nodiscard]] unit_id find(std::string_view name) const;
  [[nodiscard]] std::size_t unit_count() const noexcept;
  [[nodiscard]] std::string_view name(unit_id u) const;
  [[nodiscard]] const unit_policy& policy(unit_id u) const;
  [[nodiscard]] std::size_t device_bytes(unit_id u) const;
  [[nodiscard]] unit_state state(unit_id u) const;

  /// @brief The home copy. Call flush() first for current values; writing to it between flush()
  /// and the next acquire sets what the device will see.
  ///
  /// A unit whose home is on disk (home = "disk") is viewed in its host-cache block, which the
  /// next call to this runtime (another home() included) may give to another unit: use each view
  /// before taking the next (the sample initialises such units one at a time). A host home's view
  /// stays valid for the runtime's life.
  [[nodiscard]] home_view home(unit_id u);

  /// @brief Appends upcoming steps; the first step not yet begun is the next to run. Checks that
  /// at every point of each step the pinned units plus the units held at once fit the budget.
  /// @throws config_error naming the step, the units held and the bytes, when they do not
  void plan(std::span<const step_plan> steps);
  void plan(const step_plan& step) { plan(std::span<const step_plan>(&step, 1)); }

  /// @brief Device views of `u`; `s` waits (on the device) for its swap-in. Does not synchronise.
  /// @param use unit_use::frozen: forward only. The view has parameters and no gradients; only
  /// release() may follow. A unit that is not resident comes in with its parameters alone; one
  /// that is resident keeps its slot, which the runtime narrows to the parameters (writing the
  /// rest home first if it changed) only when it needs the room. With a communicator a frozen
  /// use costs no bytes on any rank, unless another rank trains the unit in the same step: then
  /// this rank's replica takes the update too (replicas stay equal), after the frozen use, as
  /// the average of the ranks that trained it (or over the world with average = "world").
  /// Without a communicator an acquisition whose use differs from the plan's counts as unplanned.
  /// @throws invalid_argument if `u` is already held, or (with a communicator) the plan announced
  /// it with the other use
  /// @throws out_of_memory if `u` does not fit next to the units held now (a step off its plan)
  [[nodiscard]] unit_view acquire(unit_id u, stream_view s, unit_use use = unit_use::train);
  /// @brief `u`'s gradients are complete on `s`. Does not synchronise.
  /// @throws invalid_argument if `u` is not held, or is used frozen
  void grads_ready(unit_id u, stream_view s);
  /// @brief One AdamW step of `u` after the work on `s`: on `s` (device placement), or on the
  /// CPU after its gradients came home (host placement). Gradients are zero afterwards.
  /// With a communicator the update follows u's reduction, on the runtime's own stream unless the
  /// reduction has ended, so that `s` goes on meanwhile. It may then run before u's release: work
  /// queued between step() and release() must not touch u's parameters, gradients or state. The
  /// next acquisition of u sees the update. Does not synchronise.
  /// @throws invalid_argument if `u` is not held, or is used frozen
  void step(unit_id u, stream_view s);
  /// @brief Ends the use of `u` on `s`; its device memory may be reused after the work on `s`.
  /// Does not synchronise.
  void release(unit_id u, stream_view s);
  /// @brief The current step will not acquire these units again (an early exit skips the layers
  /// above it): their planned acquisitions still ahead in the step are dropped now, not at
  /// end_step(), so the prefetch stops keeping room for them and brings the uses after them
  /// instead. Skip them in one call: the prefetch runs once, after all are dropped. A unit with
  /// nothing planned ahead is left as it is. With a communicator a use the ranks agreed to reduce
  /// (the unit trained in the step, here or on another rank) is completed as end_step() would
  /// complete it: this rank contributes zero gradients and takes the update, now (give the units
  /// in the order their gradients would have been ready, the last layer first). Does not
  /// synchronise.
  /// @throws invalid_argument if a unit with uses ahead is held by the trainer (release it first)
  /// @throws out_of_memory with a communicator, if a unit's update does not fit beside the units held
  void skip(std::span<const unit_id> units);
  void skip(unit_id u) { skip(std::span<const unit_id>(&u, 1)); }
  /// @brief Ends the step: moves to the next planned one and returns this step's figures (the
  /// stall time of swap-ins not yet finished on the device is added when they finish).
  /// @throws invalid_argument if a unit is still held
  step_stats end_step();

  /// @brief Agrees with the other ranks whether to stop, at a step boundary (after end_step).
  /// `local` is this rank's reason to stop (a signal number from stop_signals::signal(), or any
  /// positive code; 0: none). With a communicator the call is collective and must be made at the
  /// same boundaries on every rank (every step is simplest). Every 16th call enqueues a vote of
  /// `local` without waiting and returns the previous vote's result — the code of the lowest rank
  /// that gave one — so every rank stops at the same boundary, at most 32 calls after the first
  /// request, whichever rank was asked and whenever; the calls between cost nothing. Without a communicator it returns `local` and costs nothing.
  /// @return 0 to go on; else the agreed code
  /// @throws comm_error or timeout_error if the collective fails
  [[nodiscard]] int agree_stop(int local);

  /// @brief Writes dirty units back and waits until every home copy is current. Synchronises.
  /// @throws invalid_argument if a unit is held
  void flush();

  /// @brief Writes a checkpoint of every unit's home state, the plan position (steps ended) and
  /// the optimizer settings to the directory `dir` (see checkpoint.hpp), with the trainer's own
  /// entries: writes dirty units back first, writes into a temporary directory, flushes it to the
  /// disk and renames it into place (an existing checkpoint there is replaced only once the new
  /// one is complete). With a communicator: collective; each rank's replica is checked against
  /// the others (checksums), rank 0 writes while the others wait (within [comm] timeout), and
  /// every rank learns whether it succeeded. Synchronises (docs/reliability.md).
  /// @param dir the checkpoint directory ("ck" and "ck/" are the same); its parent must exist
  /// @param user the trainer's own entries, returned by load_checkpoint
  /// @throws invalid_argument if a unit is held
  /// @throws checkpoint_error if it cannot be written (nothing at `dir` is changed then), or the
  /// ranks' replicas differ
  void save_checkpoint(const std::filesystem::path& dir, const std::map<std::string, std::string>& user = {});

  /// @brief Restores every unit's home state, the plan position and the optimizer settings from
  /// the checkpoint in `dir`, before the first plan or acquire (as initial values are written).
  /// Everything is checked before anything is changed: the manifest, that it has exactly this
  /// runtime's units with the same compute dtypes and tensor shapes (policies and placements may
  /// differ), the size of data.bin and every slab's checksum. With a communicator: collective;
  /// every rank loads and every rank learns whether all did. If reading the slabs fails after the
  /// checks passed, the home copies are partly overwritten and every call but load_checkpoint
  /// throws until one succeeds.
  /// @param dir the checkpoint directory
  /// @returns the manifest (steps_done: where the trainer's schedule resumes; user: its entries)
  /// @throws checkpoint_error naming the unit and what differs, or the slab that is corrupted
  /// @throws invalid_argument after the first plan or acquire
  checkpoint_manifest load_checkpoint(const std::filesystem::path& dir);

  /// @brief Replaces the AdamW hyperparameters (learning-rate schedules), checked as the config
  /// loader checks them (lr > 0, eps > 0, weight_decay >= 0, betas in [0, 1), all finite). Each
  /// unit's step uses lr times its policy's lr_scale, and its policy's weight_decay where it has one.
  /// Without a communicator every update enqueued after the call uses them, also within a step.
  /// With one, a step's updates all use the values set when the step began (its first acquire),
  /// whichever order the ranks enqueue them in; a call within a step takes effect from the next
  /// one. Every rank must set the same values at the same step boundary (replicas diverge
  /// otherwise; the checksums of save_checkpoint() would then refuse the checkpoint).
  /// @throws config_error naming the option and the rule, with nothing changed
  void set_optimizer(const adamw_options& options);
  /// @brief The hyperparameters the next step begins with.
  [[nodiscard]] const adamw_options& optimizer() const noexcept;

  /// @brief Whether steps are guarded: a loss scaler or clipping ([optimizer] clip > 0) was on
  /// when the runtime was made. A guarded step updates its units together at end_step(), once
  /// every gradient of the step (on every rank) is known: step() and release() of a trained unit
  /// defer its update and its room until then, and the plan check counts it to the step's end.
  [[nodiscard]] bool guards_steps() const noexcept;
  /// @brief The current loss scale in device memory (one float): the trainer's loss kernel reads
  /// it (multiplying the loss, or the seed of the backward pass, by it). Valid on a stream from
  /// the step's first acquire on it; the runtime changes it on its own stream at end_step(), and
  /// the next step's first acquire orders that stream after it. Does not synchronise.
  /// @throws invalid_argument when no loss scaler is enabled
  [[nodiscard]] const float* loss_scale() const;
  /// @brief The scaler's state and the last step's norm, read from the device. Synchronises.
  /// @throws invalid_argument when steps are not guarded
  [[nodiscard]] loss_scaler_state scaler_state();

  /// @brief This process's rank and the number of ranks (0 and 1 without a communicator). A
  /// trainer launched with mpirun uses them to pick the tasks it trains.
  [[nodiscard]] int rank() const noexcept;
  [[nodiscard]] int world_size() const noexcept;

  [[nodiscard]] runtime_stats stats() const;
  /// @brief Writes a Chrome trace (JSON; opens in Perfetto) of the spans recorded since
  /// construction: a track per stream and a counter of device bytes in use. Synchronises.
  /// @throws invalid_argument unless the options enabled the trace
  void write_trace(const std::filesystem::path& file);

  [[nodiscard]] const device& get_device() const noexcept;

  /// The implementation, opaque here (named so that the library's own files can work on it).
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace taskswap
