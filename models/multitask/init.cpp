// SPDX-License-Identifier: Apache-2.0
// The sample model's initial values (model_internal.hpp): He-uniform weights from the seed, zero
// biases and adapter output layers, written to every unit's master before the first plan.

#include "model_internal.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

namespace multitask::detail {

namespace {

void initialise_unit(const model_config& model, const taskswap::home_view& home, std::size_t u)
{
  auto* master = static_cast<float*>(home.master.data);
  for (std::size_t ti = 0; ti < home.tensors.size(); ++ti) {
    const taskswap::tensor_info& t = home.tensors[ti];
    float* w = master + t.offset;
    if (t.shape.size() == 1 || t.name == "w2") {  // biases, and each adapter's output layer, start at zero
      std::fill(w, w + t.count, 0.0F);
      continue;
    }
    // He's bound; a trunk layer's, over the square root of the depth: each residual branch
    // then adds about 1/depth of the signal's power, so the trunk's output stays near its input's.
    float bound = std::sqrt(6.0F / static_cast<float>(t.shape[0]));
    if (u < static_cast<std::size_t>(model.trunk_layers)) {
      bound /= std::sqrt(static_cast<float>(model.trunk_layers));
    }
    const std::uint64_t key = key_of(model.seed, key_init, u, ti);
    for (std::size_t i = 0; i < t.count; ++i) { w[i] = bound * uniform(key, i); }
  }
}

}  // namespace

void initialise_homes(taskswap::runtime& rt, const model_config& model)
{
  // The trunk and the adapters; activation blocks (last, where the trunk's are offloaded) start empty.
  const auto n = static_cast<std::size_t>(model.trunk_layers) + static_cast<std::size_t>(model.tasks);
  const auto policy = [&](std::size_t u) { return rt.policy({static_cast<std::uint32_t>(u)}); };
  // A cached home's view (a disk home's) lasts until the next call to the runtime: those units one at a time.
  for (std::size_t u = 0; u < n; ++u) {
    if (taskswap::home_is_cached(policy(u))) { initialise_unit(model, rt.home({static_cast<std::uint32_t>(u)}), u); }
  }
  // The others on all the host's threads (a GPU configuration holds hundreds of millions of weights).
  std::vector<taskswap::home_view> homes;
  std::vector<std::size_t> in_memory;
  for (std::size_t u = 0; u < n; ++u) {
    if (!taskswap::home_is_cached(policy(u))) {
      homes.push_back(rt.home({static_cast<std::uint32_t>(u)}));
      in_memory.push_back(u);
    }
  }
  const std::size_t workers = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 64);
  std::atomic<std::size_t> next{0};
  const auto work = [&] {
    for (std::size_t i = next++; i < homes.size(); i = next++) { initialise_unit(model, homes[i], in_memory[i]); }
  };
  std::vector<std::jthread> threads;
  for (std::size_t w = 1; w < workers; ++w) { threads.emplace_back(work); }
  work();
}

}  // namespace multitask::detail
