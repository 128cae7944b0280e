// SPDX-License-Identifier: Apache-2.0
#pragma once

// The runtime tests' training loop and what they compare: a step that trains some units with
// gradients drawn from (unit, step), and every unit's home as bytes.

#include <taskswap/taskswap.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace taskswap::test {

/// One step on `s`: each unit acquired, given gradients that are a function of (unit, step),
/// stepped and released, in order; then end_step.
inline void train_step(runtime& rt, stream_view s, std::initializer_list<unit_id> units, std::uint64_t step)
{
  for (const unit_id u : units) {
    const unit_view v = rt.acquire(u, s);
    auto* g = static_cast<float*>(v.grads.data);
    const std::size_t n = v.grads.count;
    launch_host_func(s, [g, n, step, u] {
      for (std::size_t k = 0; k < n; ++k) {
        g[k] = 0.001F * static_cast<float>((k + step * 31 + u.value * 17) % 53) - 0.026F;
      }
    });
    rt.grads_ready(u, s);
    rt.step(u, s);
    rt.release(u, s);
  }
  (void)rt.end_step();
}

/// Every unit's home slabs (params, master, m, v) and step, as bytes, after a flush. Each home is
/// read before the next is taken (a disk home's view lasts until the next call).
inline std::string home_state(runtime& rt)
{
  rt.flush();
  std::string out;
  for (std::size_t i = 0; i < rt.unit_count(); ++i) {
    const home_view h = rt.home({static_cast<std::uint32_t>(i)});
    for (const slab_view& v : {h.params, h.master, h.m, h.v}) {
      out.append(static_cast<const char*>(v.data), v.bytes());
    }
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
    out.append(reinterpret_cast<const char*>(&h.step), sizeof h.step);
  }
  return out;
}

}  // namespace taskswap::test
