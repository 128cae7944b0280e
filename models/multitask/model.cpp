// SPDX-License-Identifier: Apache-2.0
#include "model.hpp"

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

constexpr std::size_t alignment = 256;

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

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
  const std::array<int_key, 10> ints{{{"tasks", &m.tasks, 1},
                                      {"trunk_layers", &m.trunk_layers, 1},
                                      {"width", &m.width, 1},
                                      {"adapter_hidden", &m.adapter_hidden, 1},
                                      {"outputs", &m.outputs, 1},
                                      {"batch", &m.batch, 1},
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
                         "'; the keys are tasks, trunk_layers, width, adapter_hidden, outputs, dtype, batch, steps, "
                         "seed, log_every, plan_window, freeze_trunk_after");
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
  return m;
}

std::uint64_t key_of(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t c)
{
  return mix(seed ^ mix(a ^ mix(b ^ mix(c))));
}

enum : std::uint64_t { key_input = 1, key_teacher = 2, key_init = 3, key_sampler = 4 };

}  // namespace

configuration parse_configuration(std::string_view text, std::string_view source)
{
  static constexpr std::array<std::string_view, 2> own{"model", "headroom"};
  configuration c;
  c.runtime = taskswap::parse_config(text, source, own);
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw config_error(std::string(source) + ": " + std::string(e.description()));
  }
  c.model = read_model(root, source);
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

std::vector<taskswap::unit_spec> model_units(const model_config& m)
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
  return units;
}

int task_of_step(const model_config& m, int rank, std::int64_t step)
{
  return static_cast<int>(
    key_of(m.seed, key_sampler, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step)) %
    static_cast<std::uint64_t>(m.tasks));
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
                                 taskswap::unit_id adapter, std::int64_t step, bool streamed)
{
  taskswap::step_plan p;
  const bool frozen = m.trunk_frozen(step);
  if (!streamed) {
    for (taskswap::unit_id u : trunk) { p.acquire(u, frozen ? taskswap::unit_use::frozen : taskswap::unit_use::train); }
    p.acquire(adapter);
    return p;
  }
  for (taskswap::unit_id u : trunk) { p.acquire(u, taskswap::unit_use::frozen).release(u); }
  p.acquire(adapter);
  if (!frozen) {
    p.release(adapter);
    for (auto it = trunk.rbegin(); it != trunk.rend(); ++it) { p.acquire(*it).release(*it); }
  }
  return p;
}

namespace {

// The buffers of one batch: activations (per sample) first, then the fixed ones.
struct buffer_sizes {
  std::vector<std::size_t> per_sample;  // floats per sample of each per-sample buffer
  std::vector<std::size_t> fixed;  // floats of each fixed buffer
};

buffer_sizes buffers_of(const model_config& m, int steps)
{
  const auto d = static_cast<std::size_t>(m.width);
  const auto h = static_cast<std::size_t>(m.adapter_hidden);
  const auto o = static_cast<std::size_t>(m.outputs);
  buffer_sizes b;
  for (int l = 0; l <= m.trunk_layers; ++l) { b.per_sample.push_back(d); }  // h_0 (input) … h_L
  for (int l = 0; l < m.trunk_layers; ++l) { b.per_sample.push_back(d); }  // each layer's branch r_l
  b.per_sample.push_back(h);  // adapter hidden
  b.per_sample.push_back(o);  // output, then dLoss/dy
  b.per_sample.push_back(o);  // target
  b.per_sample.push_back(std::max(d, h));  // backward, ping
  b.per_sample.push_back(std::max(d, h));  // backward, pong
  b.fixed.push_back(d * o);  // the teacher of the step
  b.fixed.push_back(std::max<std::size_t>(static_cast<std::size_t>(steps), 64));  // losses (at least 256 bytes)
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

}  // namespace

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
  // Every unit pinned: packed one after another (256-byte aligned), in whole granules of the pool.
  std::size_t packed = 0;
  for (const taskswap::unit_spec& u : units) {
    packed += round_up(taskswap::footprint(u, taskswap::optimizer_placement::device).device_bytes, 256);
  }
  const std::size_t granule = taskswap::make_device(o.device).granularity();
  o.device.budget = round_up(packed, granule);
  // Loss scaling and clipping keep their state beside the units, in whole granules.
  if (o.scaler.enabled || o.optimizer.clip > 0) {
    o.device.budget += round_up(taskswap::step_guard_device_bytes(units.size()), granule);
  }
  return o;
}

struct trainer::impl {
  impl(const taskswap::device& d, const taskswap::runtime_options& options, const model_config& m, int b, int s,
       std::shared_ptr<taskswap::communicator> c)
      : dev(d),
        model(m),
        batch(b),
        steps(s),
        compute(dev),
        comm(c                                                      ? std::move(c)
             : options.comm.backend == taskswap::comm_backend::none ? nullptr
                                                                    : taskswap::make_communicator(dev, options.comm)),
        rt(dev, options, model_units(m), comm),
        kernels(make_ops(dev, compute)),
        workspace(dev, workspace_bytes()),
        losses_home(dev, static_cast<std::size_t>(steps) * sizeof(float))
  {
    margin = plan_margin(model, options);
    if (options.scaler.enabled) { loss_scale = rt.loss_scale(); }
    for (int l = 0; l < model.trunk_layers; ++l) { trunk.push_back(rt.find("trunk/" + std::to_string(l))); }
    streamed = trunk_streams(model, options);
    for (int t = 0; t < model.tasks; ++t) { tasks.push_back(rt.find("task/" + std::to_string(t))); }
    carve();
  }

  [[nodiscard]] std::size_t workspace_bytes() const
  {
    const buffer_sizes b = buffers_of(model, steps);
    std::size_t bytes = 0;
    for (std::size_t n : b.per_sample) {
      bytes += round_up(n * static_cast<std::size_t>(batch) * sizeof(float), alignment);
    }
    for (std::size_t n : b.fixed) { bytes += round_up(n * sizeof(float), alignment); }
    return bytes;
  }

  void carve()
  {
    const buffer_sizes b = buffers_of(model, steps);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the workspace holds f32 arrays
    auto* base = reinterpret_cast<float*>(workspace.data());
    std::size_t offset = 0;
    std::vector<float*> out;
    const auto take = [&](std::size_t floats) {
      out.push_back(base + offset / sizeof(float));
      offset += round_up(floats * sizeof(float), alignment);
    };
    for (std::size_t n : b.per_sample) { take(n * static_cast<std::size_t>(batch)); }
    for (std::size_t n : b.fixed) { take(n); }
    std::size_t i = 0;
    for (int l = 0; l <= model.trunk_layers; ++l) { h.push_back(out[i++]); }
    for (int l = 0; l < model.trunk_layers; ++l) { branch.push_back(out[i++]); }
    hidden = out[i++];
    y = out[i++];
    target = out[i++];
    back[0] = out[i++];
    back[1] = out[i++];
    teacher = out[i++];
    losses = out[i++];
    scratch = out[i++];
    if (model.compute != dtype::f32) {
      wide_weight = out[i++];
      wide_grad = out[i++];
      wide_bias = out[i++];
      wide_bias_grad = out[i++];
    }
  }

  // The initial values, before the first run() or save (a resumed run takes the checkpoint's
  // instead, and writes no home: with disk homes that would be a pass over every unit file).
  void initialise_once()
  {
    if (initialised) { return; }
    initialise();
    initialised = true;
  }

  // He-uniform weights from the seed, zero biases and output layers, written to every unit's master before the first plan.
  void initialise()
  {
    // Units on all the host's threads (a GPU configuration holds hundreds of millions of weights).
    const std::size_t n = rt.unit_count();
    // A cached home's view (a disk home's) lasts until the next call to the runtime: those units one at a time.
    for (std::size_t u = 0; u < n; ++u) {
      if (taskswap::home_is_cached(rt.policy({static_cast<std::uint32_t>(u)}))) {
        initialise_unit(rt.home({static_cast<std::uint32_t>(u)}), u);
      }
    }
    std::vector<taskswap::home_view> homes;
    std::vector<std::size_t> in_memory;
    for (std::size_t u = 0; u < n; ++u) {
      if (!taskswap::home_is_cached(rt.policy({static_cast<std::uint32_t>(u)}))) {
        homes.push_back(rt.home({static_cast<std::uint32_t>(u)}));
        in_memory.push_back(u);
      }
    }
    const std::size_t workers = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 64);
    std::atomic<std::size_t> next{0};
    const auto work = [&] {
      for (std::size_t i = next++; i < homes.size(); i = next++) { initialise_unit(homes[i], in_memory[i]); }
    };
    std::vector<std::jthread> threads;
    for (std::size_t w = 1; w < workers; ++w) { threads.emplace_back(work); }
    work();
  }

  void initialise_unit(const taskswap::home_view& home, std::size_t u) const
  {
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
  }

  // The f32 view of tensor `i` of `v`: the parameters themselves, or a widened copy.
  const float* weight(const taskswap::unit_view& v, std::size_t i, float* wide)
  {
    if (model.compute == dtype::f32) { return static_cast<const float*>(v.param(i)); }
    kernels->widen(wide, v.param(i), model.compute, v.tensors[i].count);
    return wide;
  }
  // Where the gradient of tensor `i` is computed (f32), and its storing into the slab.
  float* grad_target(const taskswap::unit_view& v, std::size_t i, float* wide)
  {
    return model.compute == dtype::f32 ? static_cast<float*>(v.grad(i)) : wide;
  }
  void store_grad(const taskswap::unit_view& v, std::size_t i, float* wide)
  {
    if (model.compute != dtype::f32) { kernels->narrow(v.grad(i), model.compute, wide, v.tensors[i].count); }
  }

  // Forward and backward of one step; returns nothing, the loss lands in losses[step]. A streamed
  // trunk acquires each layer for its forward (parameters alone) and releases it, and again for
  // its backward, stepped and released at once; the adapter comes in after the trunk's forward.
  // The arithmetic is the same either way, so a streamed run equals a held one bit for bit.
  void train_step(std::int64_t step)
  {
    const int task = task_of_step(model, rank(), step);
    const int b = batch;
    const int d = model.width;
    const int hd = model.adapter_hidden;
    const int o = model.outputs;
    const int layers = model.trunk_layers;
    const auto act = [this](int l) { return h[static_cast<std::size_t>(l)]; };
    const bool frozen = model.trunk_frozen(step);
    const taskswap::unit_id adapter = tasks[static_cast<std::size_t>(task)];
    std::vector<taskswap::unit_view> tv(trunk.size());
    taskswap::unit_view av;
    if (!streamed) {
      for (std::size_t l = 0; l < trunk.size(); ++l) {
        tv[l] = rt.acquire(trunk[l], compute, frozen ? taskswap::unit_use::frozen : taskswap::unit_use::train);
      }
      av = rt.acquire(adapter, compute);
    }

    // The batch and its targets: x random, y = x · A_task.
    kernels->random_uniform(
      act(0), static_cast<std::size_t>(b) * static_cast<std::size_t>(d),
      key_of(model.seed, key_input, static_cast<std::uint64_t>(rank()), static_cast<std::uint64_t>(step)), 1.0F);
    // The teacher: a part every task shares (what the trunk can learn once) plus the task's own.
    const std::size_t teacher_size = static_cast<std::size_t>(d) * static_cast<std::size_t>(o);
    const float scale = std::sqrt(3.0F / static_cast<float>(d));
    kernels->random_uniform(teacher, teacher_size, key_of(model.seed, key_teacher, 0, 0), scale);
    kernels->gemm(false, false, b, o, d, 1.0F, act(0), teacher, 0.0F, target);
    kernels->random_uniform(teacher, teacher_size, key_of(model.seed, key_teacher, 1, static_cast<std::uint64_t>(task)),
                            0.5F * scale);
    kernels->gemm(false, false, b, o, d, 1.0F, act(0), teacher, 1.0F, target);

    // Forward.
    for (int l = 0; l < layers; ++l) {
      const taskswap::unit_id u = trunk[static_cast<std::size_t>(l)];
      auto& v = tv[static_cast<std::size_t>(l)];
      if (streamed) { v = rt.acquire(u, compute, taskswap::unit_use::frozen); }
      // A residual block: h_{l+1} = h_l + r_l, r_l = relu(h_l W_l + b_l).
      float* r = branch[static_cast<std::size_t>(l)];
      kernels->gemm(false, false, b, d, d, 1.0F, act(l), weight(v, 0, wide_weight), 0.0F, r);
      kernels->bias_activation(r, weight(v, 1, wide_bias), b, d, true);
      kernels->add(act(l + 1), act(l), r, static_cast<std::size_t>(b) * static_cast<std::size_t>(d));
      if (streamed) { rt.release(u, compute); }
    }
    if (streamed) { av = rt.acquire(adapter, compute); }
    kernels->gemm(false, false, b, hd, d, 1.0F, act(layers), weight(av, 0, wide_weight), 0.0F, hidden);
    kernels->bias_activation(hidden, weight(av, 1, wide_bias), b, hd, true);
    kernels->gemm(false, false, b, o, hd, 1.0F, hidden, weight(av, 2, wide_weight), 0.0F, y);
    kernels->bias_activation(y, weight(av, 3, wide_bias), b, o, false);
    kernels->mse(y, target, b, o, losses + step, scratch, loss_scale);

    // Backward through the adapter (y now holds dLoss/dy).
    kernels->gemm(true, false, hd, o, b, 1.0F, hidden, y, 0.0F, grad_target(av, 2, wide_grad));
    store_grad(av, 2, wide_grad);
    kernels->column_sums(grad_target(av, 3, wide_bias_grad), y, b, o, scratch);
    store_grad(av, 3, wide_bias_grad);
    kernels->gemm(false, true, b, hd, o, 1.0F, y, weight(av, 2, wide_weight), 0.0F, back[0]);
    kernels->relu_backward(back[0], back[0], hidden, static_cast<std::size_t>(b) * static_cast<std::size_t>(hd));
    kernels->gemm(true, false, d, hd, b, 1.0F, act(layers), back[0], 0.0F, grad_target(av, 0, wide_grad));
    store_grad(av, 0, wide_grad);
    kernels->column_sums(grad_target(av, 1, wide_bias_grad), back[0], b, hd, scratch);
    store_grad(av, 1, wide_bias_grad);
    if (frozen) {  // the trunk takes no gradient: backward ends at the adapter
      finish(av.id);
      if (!streamed) {
        for (auto it = trunk.rbegin(); it != trunk.rend(); ++it) { rt.release(*it, compute); }
      }
      last_stats = rt.end_step();
      return;
    }
    kernels->gemm(false, true, b, d, hd, 1.0F, back[0], weight(av, 0, wide_weight), 0.0F, back[1]);
    finish(av.id);

    // Backward through the trunk, last layer first; each layer's update overlaps the rest. dh
    // holds dLoss/dh_{l+1}; the branch's gradient dr = dh masked by r_l > 0; then dh += dr W_l^T
    // is dLoss/dh_l (the skip path and the branch's).
    float* dh = back[1];
    float* dr = back[0];
    for (int l = layers - 1; l >= 0; --l) {
      auto& v = tv[static_cast<std::size_t>(l)];
      if (streamed) { v = rt.acquire(trunk[static_cast<std::size_t>(l)], compute); }
      kernels->relu_backward(dr, dh, branch[static_cast<std::size_t>(l)],
                             static_cast<std::size_t>(b) * static_cast<std::size_t>(d));
      kernels->gemm(true, false, d, d, b, 1.0F, act(l), dr, 0.0F, grad_target(v, 0, wide_grad));
      store_grad(v, 0, wide_grad);
      kernels->column_sums(grad_target(v, 1, wide_bias_grad), dr, b, d, scratch);
      store_grad(v, 1, wide_bias_grad);
      if (l > 0) { kernels->gemm(false, true, b, d, d, 1.0F, dr, weight(v, 0, wide_weight), 1.0F, dh); }
      finish(v.id);
    }
    last_stats = rt.end_step();
  }

  void finish(taskswap::unit_id u)
  {
    rt.grads_ready(u, compute);
    rt.step(u, compute);
    rt.release(u, compute);
  }

  // Plans the next window when the steps planned ahead fall to the margin (all ranks alike).
  void plan_ahead(std::int64_t step)
  {
    if (planned_until < steps && planned_until - step <= (planned_until == first_step ? 0 : margin)) {
      plan_from(planned_until);
    }
  }

  void plan_from(std::int64_t first)
  {
    const std::int64_t end = std::min<std::int64_t>(first + model.plan_window, steps);
    planned_until = end;
    std::vector<taskswap::step_plan> plans;
    for (std::int64_t s = first; s < end; ++s) {
      plans.push_back(
        step_plan_of(model, trunk, tasks[static_cast<std::size_t>(task_of_step(model, rank(), s))], s, streamed));
    }
    rt.plan(plans);
  }

  [[nodiscard]] int rank() const noexcept { return comm ? comm->rank() : 0; }
  [[nodiscard]] int world() const noexcept { return comm ? comm->size() : 1; }

  taskswap::device dev;
  model_config model;
  int batch;
  int steps;
  taskswap::stream compute;
  std::shared_ptr<taskswap::communicator> comm;
  taskswap::runtime rt;
  bool streamed = false;  // the trunk streams within each step
  std::unique_ptr<ops> kernels;
  taskswap::device_buffer workspace;
  taskswap::pinned_buffer losses_home;
  std::vector<taskswap::unit_id> trunk;
  std::vector<taskswap::unit_id> tasks;
  std::vector<float*> h;
  std::vector<float*> branch;  // each trunk layer's r_l, whose sign the backward masks by
  float* hidden = nullptr;
  float* y = nullptr;
  float* target = nullptr;
  std::array<float*, 2> back{};
  float* teacher = nullptr;
  float* losses = nullptr;
  float* scratch = nullptr;
  float* wide_weight = nullptr;
  float* wide_grad = nullptr;
  float* wide_bias = nullptr;
  float* wide_bias_grad = nullptr;
  const float* loss_scale = nullptr;  // the runtime's, on the device, with [scaler] enabled
  taskswap::step_stats last_stats{};
  int margin = 1;
  std::int64_t first_step = 0;  // where run() starts (a resumed checkpoint's position)
  bool initialised = false;  // the homes hold the initial values or a checkpoint's
  std::int64_t planned_until = 0;  // steps planned so far
};

trainer::trainer(const taskswap::device& dev, const taskswap::runtime_options& options, const model_config& model,
                 int batch, int steps, std::shared_ptr<taskswap::communicator> comm)
    : impl_(std::make_unique<impl>(dev, options, model, batch, steps, std::move(comm)))
{}

trainer::~trainer() = default;

taskswap::runtime& trainer::get_runtime() noexcept { return impl_->rt; }
int trainer::rank() const noexcept { return impl_->rank(); }
int trainer::world() const noexcept { return impl_->world(); }

std::int64_t trainer::resume(const std::filesystem::path& checkpoint)
{
  impl& m = *impl_;
  // Checked before anything is loaded: the schedule depends on the seed and on the ranks.
  const taskswap::checkpoint_manifest c = taskswap::read_checkpoint_manifest(checkpoint);
  if (c.world != m.world()) {
    throw taskswap::checkpoint_error("checkpoint '" + checkpoint.string() + "' was saved by " +
                                     std::to_string(c.world) + " rank(s), this run has " + std::to_string(m.world()) +
                                     "; resume with as many ranks (each rank's task schedule depends on it)");
  }
  const auto entry = [&](const std::string& key) {
    const auto it = c.user.find(key);
    return it == c.user.end() ? std::string("(none)") : it->second;
  };
  if (entry("model.seed") != std::to_string(m.model.seed)) {
    throw taskswap::checkpoint_error("checkpoint '" + checkpoint.string() + "' was trained with [model] seed = " +
                                     entry("model.seed") + ", this run has " + std::to_string(m.model.seed) +
                                     "; resume with the same seed (the task schedule depends on it)");
  }
  if (static_cast<std::int64_t>(c.steps_done) > m.steps) {
    throw taskswap::checkpoint_error("checkpoint '" + checkpoint.string() + "' is at step " +
                                     std::to_string(c.steps_done) + ", beyond this run's " + std::to_string(m.steps) +
                                     " steps; raise --steps");
  }
  m.first_step = static_cast<std::int64_t>(m.rt.load_checkpoint(checkpoint).steps_done);
  m.initialised = true;
  return m.first_step;
}

run_result trainer::run(const run_options& options)
{
  impl& m = *impl_;
  m.initialise_once();
  const auto& on_log = options.on_log;
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): f32 array
  auto* host_losses = reinterpret_cast<float*>(m.losses_home.data());
  const auto copy_losses = [&](std::int64_t first, std::int64_t end) {
    const std::size_t off = static_cast<std::size_t>(first) * sizeof(float);
    const std::size_t n = static_cast<std::size_t>(end - first) * sizeof(float);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a float's place in bytes
    const auto* at = reinterpret_cast<std::byte*>(m.losses + first);
    const auto from = static_cast<std::size_t>(at - m.workspace.data());
    taskswap::copy_async(m.losses_home.span().subspan(off, n), m.workspace.span().subspan(from, n), m.compute);
  };
  // Loss lines lag one interval: the copy of an interval is read when the next one is queued.
  struct pending {
    std::int64_t first;
    std::int64_t end;
    taskswap::event done;
    std::size_t reduced_bytes = 0;  // allreduced over the interval (with several ranks)
  };
  std::optional<pending> waiting;
  const auto print = [&](const pending& p) {
    p.done.synchronize();
    std::vector<double> sum(static_cast<std::size_t>(m.model.tasks), 0.0);
    std::vector<int> count(static_cast<std::size_t>(m.model.tasks), 0);
    for (std::int64_t s = p.first; s < p.end; ++s) {
      const auto t = static_cast<std::size_t>(task_of_step(m.model, m.rank(), s));
      sum[t] += host_losses[s];
      ++count[t];
    }
    std::ostringstream line;
    line << "step " << p.end << ": mean loss ";
    double all = 0;
    for (std::size_t t = 0; t < sum.size(); ++t) { all += sum[t]; }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.4f", all / static_cast<double>(p.end - p.first));
    line << buf << " over " << (p.end - p.first) << " steps;";
    int shown = 0;
    for (std::size_t t = 0; t < sum.size() && shown < 6; ++t) {
      if (count[t] == 0) { continue; }
      std::snprintf(buf, sizeof buf, " task/%zu %.4f", t, sum[t] / count[t]);
      line << buf;
      ++shown;
    }
    if (m.world() > 1) {
      std::snprintf(buf, sizeof buf, "; reduced %.1f KiB/step",
                    static_cast<double>(p.reduced_bytes) / 1024.0 / static_cast<double>(p.end - p.first));
      line << buf;
    }
    if (on_log) { on_log(line.str()); }
  };

  const std::int64_t begin = m.first_step;
  std::int64_t end_at =
    options.stop_after >= 0 ? std::clamp<std::int64_t>(options.stop_after, begin, m.steps) : m.steps;
  const auto save = [&](std::int64_t done) {
    m.rt.save_checkpoint(options.checkpoint, {{"model.seed", std::to_string(m.model.seed)},
                                              {"model.tasks", std::to_string(m.model.tasks)},
                                              {"steps_done", std::to_string(done)}});
  };
  m.planned_until = std::max(m.planned_until, begin);
  run_result r;
  const taskswap::disk_stats disk_before = m.rt.stats().disk;  // the initial values' writes are the set-up's
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::size_t interval_reduced = 0;
  for (std::int64_t s = begin; s < end_at; ++s) {
    if (on_log && s == m.model.freeze_trunk_after && m.model.trunk_frozen(s)) {
      on_log("step " + std::to_string(s) + ": the trunk is frozen from here on; the task adapters keep training");
    }
    m.plan_ahead(s);
    m.train_step(s);
    interval_reduced += m.last_stats.reduced_bytes;
    if (s == begin) {
      m.compute.synchronize();
      start = std::chrono::steady_clock::now();
    }
    if (!options.checkpoint.empty() && options.checkpoint_every > 0 && (s + 1) % options.checkpoint_every == 0 &&
        s + 1 < end_at) {
      try {
        save(s + 1);
      } catch (const taskswap::checkpoint_error& e) {  // the previous checkpoint is still there: go on
        if (on_log) { on_log(std::string("checkpoint at step ") + std::to_string(s + 1) + " failed: " + e.what()); }
      }
    }
    if (options.stop_code) {  // every rank asks at every boundary: they stop at the same one
      const auto asked = std::chrono::steady_clock::now();
      r.stopped_by = m.rt.agree_stop(options.stop_code());
      if (s != begin) {
        r.stop_agreement_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
      }
      if (r.stopped_by != 0) { end_at = s + 1; }
    }
    const int every = m.model.log_every;
    if (every > 0 && on_log && ((s + 1) % every == 0 || s + 1 == end_at)) {
      const std::int64_t first = std::max(begin, s + 1 - ((s + 1) % every == 0 ? every : (s + 1) % every));
      copy_losses(first, s + 1);
      pending p{first, s + 1, taskswap::event(m.dev), interval_reduced};
      interval_reduced = 0;
      p.done.record(m.compute);
      if (waiting) { print(*waiting); }
      waiting = std::move(p);
    }
  }
  m.compute.synchronize();
  const auto end = std::chrono::steady_clock::now();
  if (waiting) { print(*waiting); }
  r.seconds = std::chrono::duration<double>(end - start).count();
  r.timed_steps = std::max<std::int64_t>(0, end_at - begin - 1);
  r.steps_done = end_at;
  r.first_step = begin;
  const taskswap::disk_stats disk_after = m.rt.stats().disk;
  r.disk_read_in_steps = disk_after.read_bytes - disk_before.read_bytes;
  r.disk_written_in_steps = disk_after.written_bytes - disk_before.written_bytes;
  if (!options.checkpoint.empty()) {
    save(end_at);
  } else {
    m.rt.flush();
  }
  r.tasks.resize(static_cast<std::size_t>(m.model.tasks));
  if (end_at == begin) { return r; }
  copy_losses(begin, end_at);
  m.compute.synchronize();
  for (std::int64_t s = begin; s < end_at; ++s) {
    task_losses& t = r.tasks[static_cast<std::size_t>(task_of_step(m.model, m.rank(), s))];
    t.all.push_back(host_losses[s]);
    ++t.steps;
  }
  for (task_losses& t : r.tasks) {
    if (t.all.empty()) { continue; }
    const std::size_t k = std::max<std::size_t>(1, std::min<std::size_t>(3, t.all.size() / 2));
    double first = 0;
    double last = 0;
    for (std::size_t i = 0; i < k; ++i) {
      first += t.all[i];
      last += t.all[t.all.size() - 1 - i];
    }
    t.first = static_cast<float>(first / static_cast<double>(k));
    t.last = static_cast<float>(last / static_cast<double>(k));
  }
  const taskswap::runtime_stats stats = m.rt.stats();
  r.total = stats.total;
  if (m.rt.guards_steps()) { r.scaler = m.rt.scaler_state(); }
  r.disk = m.rt.stats().disk;
  for (const taskswap::step_stats& st : stats.steps) {  // the steps after the warm-up (the last 4096)
    if (st.step <= static_cast<std::uint64_t>(begin)) { continue; }
    r.timed.h2d_bytes += st.h2d_bytes;
    r.timed.d2h_bytes += st.d2h_bytes;
    r.timed.swap_ins += st.swap_ins;
    r.timed.write_backs += st.write_backs;
    r.timed.hits += st.hits;
    r.timed.misses += st.misses;
    r.timed.stall_ms += st.stall_ms;
    r.timed.reduced_bytes += st.reduced_bytes;
    r.timed.evictions += st.evictions;
    r.timed.unplanned += st.unplanned;
    r.timed.peak_device_bytes = std::max(r.timed.peak_device_bytes, st.peak_device_bytes);
  }
  return r;
}

void trainer::save_parameters(const std::filesystem::path& file)
{
  impl& m = *impl_;
  m.initialise_once();
  m.rt.flush();
  const std::filesystem::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) { throw std::runtime_error("cannot write '" + tmp.string() + "'; check the directory"); }
    for (std::size_t u = 0; u < m.rt.unit_count(); ++u) {
      const taskswap::home_view h = m.rt.home({static_cast<std::uint32_t>(u)});
      const std::string name(m.rt.name(h.id));
      out << name << '\n';
      const auto write = [&](const taskswap::slab_view& s) {
        out.write(static_cast<const char*>(s.data), static_cast<std::streamsize>(s.bytes()));
      };
      write(h.params);
      if (h.master.data != h.params.data) { write(h.master); }  // f32: the params are the master
      write(h.m);
      write(h.v);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): raw bytes
      out.write(reinterpret_cast<const char*>(&h.step), sizeof h.step);
    }
    if (!out.flush()) { throw std::runtime_error("writing '" + tmp.string() + "' failed"); }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) {
    throw std::runtime_error("cannot rename '" + tmp.string() + "' to '" + file.string() + "': " + ec.message());
  }
}

}  // namespace multitask
