// SPDX-License-Identifier: Apache-2.0
#include "runtime/units/unit_layout.hpp"

#include "device/message.hpp"
#include "host/stream_stagger.hpp"
#include "numeric/align.hpp"

#include <limits>

namespace taskswap::detail {

namespace {

std::size_t checked_product(const unit_spec& spec, const tensor_spec& t)
{
  if (t.shape.empty()) {
    throw config_error(message("unit '", spec.name, "': tensor '", t.name, "' has no dimensions; give a shape"));
  }
  std::size_t n = 1;
  for (const std::size_t d : t.shape) {
    if (d == 0) { throw config_error(message("unit '", spec.name, "': tensor '", t.name, "' has a dimension of 0")); }
    if (n > std::numeric_limits<std::size_t>::max() / 16 / d) {
      throw config_error(message("unit '", spec.name, "': tensor '", t.name, "' is too large to address"));
    }
    n *= d;
  }
  return n;
}

}  // namespace

unit_layout make_unit_layout(const unit_spec& spec, optimizer_placement placement)
{
  if (spec.tensors.empty()) {
    throw config_error(message("unit '", spec.name, "' has no tensors; register at least one"));
  }
  const bool trainable = spec.trainable && !spec.activation;  // an activation block is never trained
  if (trainable && !(is_floating(spec.compute) && is_floating(spec.grad.value_or(spec.compute)))) {
    throw config_error(message("unit '", spec.name,
                               "': a trained unit's parameters and gradients are f32, bf16 or "
                               "f16; raw bytes (u8) are for a frozen unit: set trainable false"));
  }
  unit_layout l;
  l.compute = spec.compute;
  l.grad = spec.grad.value_or(spec.compute);
  // The trainable tensors first, in order, then the state tensors: [0, trainable) is what AdamW
  // steps and the reducer reduces, one contiguous range. tensor_info keeps the spec's order.
  l.tensors.resize(spec.tensors.size());
  for (const bool state : {false, true}) {
    if (state) { l.trainable = l.count; }
    for (std::size_t i = 0; i < spec.tensors.size(); ++i) {
      const tensor_spec& t = spec.tensors[i];
      if (t.state != state) { continue; }
      const std::size_t n = checked_product(spec, t);
      l.count = round_up(l.count, tensor_alignment);
      l.tensors[i] = tensor_info{t.name, t.shape, n, l.count, t.no_weight_decay && !t.state, t.state};
      if (!state) {
        // A tensor whose flag differs from the run before starts a run; otherwise the run grows
        // over the alignment gap and the tensor.
        if (l.runs.empty() || l.runs.back().decay == t.no_weight_decay) {
          if (!l.runs.empty()) { l.runs.back().count = l.count - l.runs.back().begin; }  // up to this tensor
          l.runs.push_back(adamw_run{l.runs.empty() ? 0 : l.count, 0, !t.no_weight_decay});
        }
      }
      l.count += n;
      if (!state) { l.runs.back().count = l.count - l.runs.back().begin; }
    }
  }
  if (!trainable) {
    // Never trained: the parameter slab is the whole unit, at home and on the device. The
    // master, m, v and gradient offsets point past it at empty slabs. An activation block's slab
    // goes home after each stash.
    l.frozen = true;
    l.activation = spec.activation;
    l.trainable = 0;
    l.runs.clear();
    l.params_bytes = round_up(l.count * size_of(l.compute), slab_alignment);
    l.state_bytes = 0;
    l.grad_bytes = 0;
    l.params = 0;
    l.master = l.m = l.v = l.home_grads = l.device_grads = l.params_bytes;
    l.home_bytes = l.device_bytes = l.travel_bytes = l.params_bytes;
    l.writeback_bytes = spec.activation ? l.params_bytes : 0;
    return l;
  }
  if (l.trainable == 0) {
    throw config_error(message("unit '", spec.name,
                               "' has only state tensors; give it a trainable tensor (state "
                               "tensors travel with one)"));
  }
  const auto slab = [&](dtype type) { return round_up(l.count * size_of(type), slab_alignment); };
  const std::size_t params_bytes = slab(l.compute);
  const std::size_t f32_bytes = slab(dtype::f32);
  const std::size_t grad_bytes = slab(l.grad);

  l.params_bytes = params_bytes;
  l.state_bytes = f32_bytes;
  l.grad_bytes = grad_bytes;
  if (placement == optimizer_placement::host) {
    // The CPU AdamW streams through params, master, m, v and the gradients at home together:
    // large ones start where no two alias (host/stream_stagger.hpp). Only home offsets move; the
    // device holds params | grads, and the params (what travels) stay at offset 0.
    const bool stagger = f32_bytes >= stagger_min_array_bytes;
    std::size_t at = params_bytes;
    std::size_t stream = 0;
    const auto place = [&]() {
      ++stream;
      if (stagger) { at = stagger_offset(0, at, stream); }
      return at;
    };
    l.params = 0;
    l.master = l.params;
    if (l.compute != dtype::f32) {
      l.master = place();
      at += f32_bytes;
    }
    l.m = place();
    at += f32_bytes;
    l.v = place();
    at += f32_bytes;
    l.home_grads = place();
    l.home_bytes = l.home_grads + grad_bytes;
    l.device_grads = params_bytes;
    l.device_bytes = params_bytes + grad_bytes;
    l.travel_bytes = params_bytes;
    l.writeback_bytes = spec.activation ? l.params_bytes : 0;
    return l;
  }
  // Device placement: params | master | m | v | grads on the device, the prefix without the
  // grads at home; the GPU does not alias like the CPU, so nothing is staggered.
  std::size_t at = params_bytes;
  l.params = 0;
  l.master = l.params;
  if (l.compute != dtype::f32) {
    l.master = at;
    at += f32_bytes;
  }
  l.m = at;
  at += f32_bytes;
  l.v = at;
  at += f32_bytes;
  l.home_grads = 0;
  l.home_bytes = at;
  l.device_grads = at;
  l.device_bytes = at + grad_bytes;
  l.travel_bytes = at;
  l.writeback_bytes = at;
  return l;
}

}  // namespace taskswap::detail
