// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where a unit's slabs lie, at home and on the device. At home: params | master | m | v | grads,
// the grads only for host placement (their home copy is what the CPU AdamW reads) and the master
// only when the compute dtype is not f32 (otherwise the params are the master). For host
// placement, slabs of 8 MiB and more start at staggered offsets at home, so that the CPU AdamW's
// streams do not alias (host/stream_stagger.hpp): up to 64 KiB between slabs, counted in home_bytes. On the device:
// params | master | m | v | grads for device placement, params | grads for host placement. The
// prefix that travels is the same bytes at the same offsets in both places, so a swap-in and a
// write-back are one copy each.

#include "host/adamw_slabs.hpp"

#include <taskswap/runtime.hpp>

#include <cstddef>
#include <vector>

namespace taskswap::detail {

inline constexpr std::size_t slab_alignment = 256;  // bytes, every slab's offset
inline constexpr std::size_t tensor_alignment = 64;  // elements, every tensor's offset in a slab

/// Elements [begin, begin + count) of a unit's slabs that AdamW steps with one setting: with the
/// optimizer's weight decay or without (tensors flagged no_weight_decay). Runs cover the slab.
struct adamw_run {
  std::size_t begin = 0;
  std::size_t count = 0;
  bool decay = true;
};

struct unit_layout {
  std::vector<tensor_info> tensors;
  std::vector<adamw_run> runs;  // consecutive tensors with the same weight-decay flag, and the gaps between them
  std::size_t count = 0;  // elements per slab, tensor padding included
  std::size_t trainable = 0;  // elements [0, trainable) hold the trainable tensors; state tensors follow
  bool frozen = false;  // never trained (unit_spec::trainable false): the parameter slab alone
  bool activation = false;  // an activation block (unit_spec::activation): frozen, written back after a stash
  dtype compute = dtype::f32;
  dtype grad = dtype::f32;
  std::size_t params_bytes = 0;  // slab sizes, alignment padding included
  std::size_t state_bytes = 0;  // one f32 slab: master, m or v
  std::size_t grad_bytes = 0;
  std::size_t params = 0;  // byte offsets from the start of the unit's block
  std::size_t master = 0;  // == params when the compute dtype is f32
  std::size_t m = 0;
  std::size_t v = 0;
  std::size_t home_grads = 0;  // host placement only
  std::size_t home_bytes = 0;
  std::size_t device_grads = 0;
  std::size_t device_bytes = 0;
  std::size_t travel_bytes = 0;  // home → device on swap-in
  std::size_t writeback_bytes = 0;  // device → home on write-back; 0 for host placement and frozen units

  [[nodiscard]] std::size_t device_grad_bytes() const noexcept { return grad_bytes; }
  /// What one reduction of the gradients moves: the tensors' elements and the alignment gaps
  /// between them (one contiguous range), not the slab's tail padding.
  [[nodiscard]] std::size_t reduce_bytes() const noexcept { return trainable * size_of(grad); }
  /// The state tensors' bytes in the parameter slab, from state_at().
  [[nodiscard]] std::size_t state_tensor_bytes() const noexcept
  {
    return frozen ? 0 : (count - trainable) * size_of(compute);  // a frozen unit's tensors never change
  }
  [[nodiscard]] std::size_t state_at() const noexcept { return params + trainable * size_of(compute); }
  /// The AdamW operands of a copy of this unit whose block starts at `base` (home or device) and
  /// whose gradients lie at `grads` bytes from it.
  [[nodiscard]] adamw_slabs slabs_at(std::byte* base, std::size_t grads) const noexcept
  {
    adamw_slabs s;
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): these slabs hold f32
    s.master = reinterpret_cast<float*>(base + master);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    s.m = reinterpret_cast<float*>(base + m);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    s.v = reinterpret_cast<float*>(base + v);
    s.grad = base + grads;
    s.grad_type = grad;
    s.params = compute == dtype::f32 ? nullptr : base + params;
    s.param_type = compute;
    s.count = count;
    return s;
  }
  /// The operands of one run: slabs_at() narrowed to its elements.
  [[nodiscard]] adamw_slabs run_slabs(const adamw_slabs& whole, const adamw_run& run) const noexcept
  {
    adamw_slabs s = whole;
    s.master += run.begin;
    s.m += run.begin;
    s.v += run.begin;
    s.grad = static_cast<const std::byte*>(whole.grad) + run.begin * size_of(grad);
    if (whole.params != nullptr) { s.params = static_cast<std::byte*>(whole.params) + run.begin * size_of(compute); }
    s.count = run.count;
    return s;
  }
};

/// The layout of `spec` under `placement`.
/// @throws config_error for a unit without tensors, an empty dimension or a size that overflows
[[nodiscard]] unit_layout make_unit_layout(const unit_spec& spec, optimizer_placement placement);

}  // namespace taskswap::detail
