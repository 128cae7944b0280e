// SPDX-License-Identifier: Apache-2.0
#include "model.hpp"

#include "model_internal.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace multitask {

using detail::alignment;
using detail::buffer_sizes;
using detail::buffers_of;
using detail::key_more_tasks;
using detail::key_of;
using detail::key_sampler;
using detail::round_up;

std::unique_ptr<ops> make_ops(const taskswap::device& dev, taskswap::stream_view s)
{
  if (dev.kind() == taskswap::backend_kind::emulated) { return make_cpu_ops(s); }
#if MULTITASK_WITH_CUDA
  return make_cuda_ops(dev.index(), s);
#else
  throw taskswap::invalid_argument("the sample was built without CUDA; use [device] backend = \"emulated\"");
#endif
}

namespace {

using taskswap::config_error;
using taskswap::dtype;

std::string at(std::string_view source, const toml::node& n)
{
  std::ostringstream s;
  s << source << ":" << n.source().begin.line;
  return s.str();
}

// Reads [model]: integers within bounds, the dtype, and nothing else.
model_config read_model(const toml::table& root, std::string_view source)
{
  model_config m;
  const toml::node* node = root.get("model");
  if (node == nullptr) { return m; }
  const toml::table* t = node->as_table();
  if (t == nullptr) { throw config_error(at(source, *node) + ": [model] must be a table"); }
  struct int_key {
    std::string_view name;
    int* value;
    int least;
  };
  const std::array<int_key, 11> ints{{{"tasks", &m.tasks, 1},
                                      {"trunk_layers", &m.trunk_layers, 1},
                                      {"width", &m.width, 1},
                                      {"adapter_hidden", &m.adapter_hidden, 1},
                                      {"outputs", &m.outputs, 1},
                                      {"batch", &m.batch, 1},
                                      {"tasks_per_step", &m.tasks_per_step, 1},
                                      {"steps", &m.steps, 1},
                                      {"log_every", &m.log_every, 0},
                                      {"plan_window", &m.plan_window, 1},
                                      {"freeze_trunk_after", &m.freeze_trunk_after, 0}}};
  for (const auto& [key, value] : *t) {
    const std::string_view k = key.str();
    const std::string where = at(source, value) + ": [model] " + std::string(k);
    if (k == "dtype") {
      const auto s = value.value<std::string>();
      if (s == "f32") {
        m.compute = dtype::f32;
      } else if (s == "bf16") {
        m.compute = dtype::bf16;
      } else if (s == "f16") {
        m.compute = dtype::f16;  // its gradients underflow without [scaler] enabled = true
      } else {
        throw config_error(where + ": use \"f32\", \"bf16\" or \"f16\"");
      }
      continue;
    }
    if (k == "seed") {
      const auto v = value.value<std::int64_t>();
      if (!v || *v < 0) { throw config_error(where + ": give a non-negative integer"); }
      m.seed = static_cast<std::uint64_t>(*v);
      continue;
    }
    const auto* ik = std::find_if(ints.begin(), ints.end(), [&](const int_key& i) { return i.name == k; });
    if (ik == ints.end()) {
      throw config_error(at(source, value) + ": [model] has no key '" + std::string(k) +
                         "'; the keys are tasks, trunk_layers, width, adapter_hidden, outputs, dtype, batch, "
                         "tasks_per_step, steps, seed, log_every, plan_window, freeze_trunk_after");
    }
    const auto v = value.value<std::int64_t>();
    constexpr std::int64_t most = std::int64_t{1} << 30;
    if (!v || *v < ik->least) {
      throw config_error(where + ": give an integer of at least " + std::to_string(ik->least));
    }
    if (*v > most) {
      throw config_error(where + ": " + std::to_string(*v) + " is too large; give at most " + std::to_string(most));
    }
    *ik->value = static_cast<int>(*v);
  }
  if (m.tasks_per_step > m.tasks || m.tasks_per_step > m.batch) {
    throw config_error(std::string(source) + ": [model] tasks_per_step = " + std::to_string(m.tasks_per_step) +
                       " is more than the " + (m.tasks_per_step > m.tasks ? "tasks" : "batch") + " (" +
                       std::to_string(std::min(m.tasks, m.batch)) +
                       "); give at most that (each task of a step "
                       "takes rows of the batch)");
  }
  return m;
}

}  // namespace

configuration parse_configuration(std::string_view text, std::string_view source)
{
  static constexpr std::array<std::string_view, 3> own{"model", "headroom", "activations"};
  configuration c;
  c.runtime = taskswap::parse_config(text, source, own);
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw config_error(std::string(source) + ": " + std::string(e.description()));
  }
  c.model = read_model(root, source);
  if (const toml::node* a = root.get("activations")) {
    const toml::table* t = a->as_table();
    if (t == nullptr) { throw config_error(at(source, *a) + ": [activations] must be a table"); }
    for (const auto& [key, value] : *t) {
      if (key.str() != "offload") {
        throw config_error(at(source, value) + ": [activations] has no key '" + std::string(key.str()) +
                           "'; the key is offload");
      }
      const auto mode = value.value<std::string>();
      if (!mode || (*mode != "host" && *mode != "none")) {
        throw config_error(at(source, value) +
                           ": [activations] offload: use \"host\" (the trunk's activations in the runtime's "
                           "activation blocks, stashed after the forward and brought back for the backward) or "
                           "\"none\"");
      }
      c.model.offload_activations = *mode == "host";
    }
  }
  if (const toml::node* h = root.get("headroom")) {
    const toml::table* t = h->as_table();
    if (t == nullptr) { throw config_error(at(source, *h) + ": [headroom] must be a table"); }
    for (const auto& [key, value] : *t) {
      const auto size = value.value<std::string>();
      if (key.str() != "device_memory" || !size) {
        throw config_error(at(source, value) + ": [headroom] has no key '" + std::string(key.str()) +
                           "' of that type; the key is device_memory = \"16 GiB\"");
      }
      try {
        c.headroom_device_memory = taskswap::parse_size(*size);
      } catch (const config_error& e) {
        throw config_error(at(source, value) + ": [headroom] device_memory: " + e.what());
      }
    }
  }
  return c;
}

configuration load_configuration(const std::filesystem::path& file)
{
  return parse_configuration(taskswap::read_config_file(file), file.string());
}

std::vector<taskswap::unit_spec> model_units(const model_config& m, int batch)
{
  const auto d = static_cast<std::size_t>(m.width);
  const auto h = static_cast<std::size_t>(m.adapter_hidden);
  const auto o = static_cast<std::size_t>(m.outputs);
  std::vector<taskswap::unit_spec> units;
  units.reserve(static_cast<std::size_t>(m.trunk_layers) + static_cast<std::size_t>(m.tasks));
  for (int l = 0; l < m.trunk_layers; ++l) {
    units.push_back(
      {.name = "trunk/" + std::to_string(l), .tensors = {{"w", {d, d}}, {"b", {d}}}, .compute = m.compute});
  }
  for (int t = 0; t < m.tasks; ++t) {
    units.push_back({.name = "task/" + std::to_string(t),
                     .tensors = {{"w1", {d, h}}, {"b1", {h}}, {"w2", {h, o}}, {"b2", {o}}},
                     .compute = m.compute});
  }
  if (m.offload_activations) {
    // Homed on the host whatever the rules say, prefetched within the step (its reads follow the stash).
    const taskswap::unit_policy block_policy{.residency = taskswap::residency::prefetch, .lookahead = 0};
    const std::size_t rows = static_cast<std::size_t>(std::max(batch, 1));
    for (int l = 0; l < m.trunk_layers; ++l) {
      for (const char* part : {"input", "branch"}) {
        units.push_back({.name = "act/" + std::to_string(l) + "/" + part,
                         .tensors = {{part, {rows, d}}},
                         .policy = block_policy,
                         .activation = true});
      }
    }
  }
  return units;
}

int task_of_step(const model_config& m, int rank, std::int64_t step)
{
  return static_cast<int>(
    key_of(m.seed, key_sampler, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step)) %
    static_cast<std::uint64_t>(m.tasks));
}

std::vector<int> tasks_of_step(const model_config& m, int rank, std::int64_t step)
{
  if (m.tasks_per_step < 1 || m.tasks_per_step > m.tasks) {
    throw taskswap::config_error("[model] tasks_per_step = " + std::to_string(m.tasks_per_step) + ": give 1 to the " +
                                 std::to_string(m.tasks) + " tasks of the model");
  }
  std::vector<int> out{task_of_step(m, rank, step)};
  for (std::uint64_t draw = 0; out.size() < static_cast<std::size_t>(m.tasks_per_step); ++draw) {
    const auto t = static_cast<int>(key_of(m.seed, key_more_tasks, static_cast<std::uint64_t>(rank),
                                           static_cast<std::uint64_t>(step) * 0x10000U + draw) %
                                    static_cast<std::uint64_t>(m.tasks));
    if (std::find(out.begin(), out.end(), t) == out.end()) { out.push_back(t); }
  }
  return out;
}

int plan_margin(const model_config& m, const taskswap::runtime_options& options)
{
  int lookahead = 0;
  for (const taskswap::unit_spec& u : model_units(m)) {
    const taskswap::unit_policy p = taskswap::policy_for(u, options);
    if (p.residency == taskswap::residency::prefetch) { lookahead = std::max(lookahead, p.lookahead); }
    if (taskswap::home_is_cached(p)) { lookahead = std::max(lookahead, options.storage.lookahead); }  // the disk hop's
  }
  return std::min(m.plan_window, lookahead + 1);
}

bool trunk_streams(const model_config& m, const taskswap::runtime_options& options)
{
  return m.trunk_layers > 0 &&
         taskswap::policy_for(model_units(m).front(), options).residency != taskswap::residency::pinned;
}

taskswap::step_plan step_plan_of(const model_config& m, std::span<const taskswap::unit_id> trunk,
                                 std::span<const taskswap::unit_id> adapters, std::int64_t step, bool streamed,
                                 std::span<const taskswap::unit_id> blocks)
{
  using taskswap::unit_use;
  taskswap::step_plan p;
  const bool frozen = m.trunk_frozen(step);
  const bool offload = !blocks.empty() && !frozen;
  const std::size_t layers = trunk.size();
  const auto input = [&](std::size_t l) { return blocks[2 * l]; };
  const auto branch = [&](std::size_t l) { return blocks[2 * l + 1]; };
  if (!streamed) {
    for (taskswap::unit_id u : trunk) { p.acquire(u, frozen ? unit_use::frozen : unit_use::train); }
    for (taskswap::unit_id a : adapters) { p.acquire(a); }
  }
  for (std::size_t l = 0; l < layers; ++l) {
    if (streamed) { p.acquire(trunk[l], unit_use::frozen); }
    if (offload) {
      p.acquire(input(l), unit_use::stash).acquire(branch(l), unit_use::stash).release(input(l)).release(branch(l));
    }
    if (streamed) { p.release(trunk[l]); }
  }
  if (!streamed) {
    if (offload) {
      for (std::size_t l = layers; l-- > 0;) {
        p.acquire(input(l), unit_use::frozen).acquire(branch(l), unit_use::frozen).release(input(l)).release(branch(l));
      }
    }
    return p;
  }
  for (taskswap::unit_id a : adapters) { p.acquire(a).release(a); }  // each stepped before the next comes
  if (!frozen) {
    for (std::size_t l = layers; l-- > 0;) {
      p.acquire(trunk[l]);
      if (offload) {
        p.acquire(input(l), unit_use::frozen).acquire(branch(l), unit_use::frozen).release(input(l)).release(branch(l));
      }
      p.release(trunk[l]);
    }
  }
  return p;
}

buffer_sizes detail::buffers_of(const model_config& m, int steps)
{
  const auto d = static_cast<std::size_t>(m.width);
  const auto h = static_cast<std::size_t>(m.adapter_hidden);
  const auto o = static_cast<std::size_t>(m.outputs);
  buffer_sizes b;
  if (m.offload_activations) {
    // h, updated in place; the layers' inputs and branches are activation blocks, but where the
    // trunk is frozen (nothing to keep for a backward): there a branch buffer.
    b.per_sample.push_back(d);
    if (m.freeze_trunk_after > 0) { b.per_sample.push_back(d); }
  } else {
    for (int l = 0; l <= m.trunk_layers; ++l) { b.per_sample.push_back(d); }  // h_0 (input) … h_L
    for (int l = 0; l < m.trunk_layers; ++l) { b.per_sample.push_back(d); }  // each layer's branch r_l
  }
  b.per_sample.push_back(h);  // adapter hidden
  b.per_sample.push_back(o);  // output, then dLoss/dy
  b.per_sample.push_back(o);  // target
  b.per_sample.push_back(std::max(d, h));  // backward, ping
  b.per_sample.push_back(std::max(d, h));  // backward, pong
  b.fixed.push_back(d * o);  // the teacher of the step
  // losses, one per task of each step (at least 256 bytes)
  b.fixed.push_back(
    std::max<std::size_t>(static_cast<std::size_t>(steps) * static_cast<std::size_t>(m.tasks_per_step), 64));
  b.fixed.push_back(scratch_floats(std::max({d, h, o})));  // the reductions' partial sums
  if (m.compute != dtype::f32) {
    const std::size_t largest = std::max({d * d, d * h, h * o});
    b.fixed.push_back(largest);  // a weight widened to f32
    b.fixed.push_back(largest);  // a weight gradient in f32
    b.fixed.push_back(std::max({d, h, o}));  // a bias widened
    b.fixed.push_back(std::max({d, h, o}));  // a bias gradient
  }
  return b;
}

workspace_size model_workspace(const model_config& m, int steps)
{
  const buffer_sizes b = buffers_of(m, steps);
  workspace_size w;
  for (std::size_t n : b.per_sample) {
    w.per_sample += n * sizeof(float);
    w.fixed += alignment;  // each per-sample buffer is rounded up to the alignment: at most this much
  }
  for (std::size_t n : b.fixed) { w.fixed += round_up(n * sizeof(float), alignment); }
  return w;
}

taskswap::runtime_options all_resident(const taskswap::runtime_options& options,
                                       const std::vector<taskswap::unit_spec>& units)
{
  taskswap::runtime_options o = options;
  o.defaults = {
    .residency = taskswap::residency::pinned, .lookahead = 0, .optimizer = taskswap::optimizer_placement::device};
  o.units.clear();
  o.device.budget = taskswap::all_pinned_budget(o, units);
  return o;
}

}  // namespace multitask
