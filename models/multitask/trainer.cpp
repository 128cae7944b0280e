// SPDX-License-Identifier: Apache-2.0
// The sample model's trainer (model.hpp): the runtime, the workspace of one batch, and the step
// (forward, backward, the step protocol), plan windows, losses, checkpoints.

#include "model.hpp"
#include "model_internal.hpp"

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

namespace {

using detail::alignment;
using detail::buffer_sizes;
using detail::buffers_of;
using detail::key_input;
using detail::key_of;
using detail::key_teacher;
using detail::round_up;
using taskswap::dtype;

}  // namespace

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
        rt(dev, options, model_units(m, b), comm),
        kernels(make_ops(dev, compute)),
        workspace(dev, workspace_bytes()),
        losses_home(dev, static_cast<std::size_t>(steps) * per_step() * sizeof(float))
  {
    if (m.tasks_per_step < 1 || m.tasks_per_step > m.tasks) {
      throw taskswap::invalid_argument("tasks_per_step = " + std::to_string(m.tasks_per_step) + ": give 1 to the " +
                                       std::to_string(m.tasks) + " tasks of the model");
    }
    if (batch < m.tasks_per_step) {
      throw taskswap::invalid_argument("a batch of " + std::to_string(batch) + " rows cannot be split among " +
                                       std::to_string(m.tasks_per_step) +
                                       " tasks per step; give a batch of at least [model] tasks_per_step");
    }
    margin = plan_margin(model, options);
    if (options.scaler.enabled) { loss_scale = rt.loss_scale(); }
    for (int l = 0; l < model.trunk_layers; ++l) { trunk.push_back(rt.find("trunk/" + std::to_string(l))); }
    streamed = trunk_streams(model, options);
    for (int t = 0; t < model.tasks; ++t) { tasks.push_back(rt.find("task/" + std::to_string(t))); }
    for (int l = 0; model.offload_activations && l < model.trunk_layers; ++l) {
      blocks.push_back(rt.find("act/" + std::to_string(l) + "/input"));
      blocks.push_back(rt.find("act/" + std::to_string(l) + "/branch"));
    }
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
    if (model.offload_activations) {
      // One h, updated in place layer by layer (h_{l+1} = h_l + r_l), and where the trunk may be
      // frozen a branch (buffers_of); a step that trains the trunk copies each layer's input into
      // its block and computes its branch there, and its backward reads both from the blocks.
      float* in_place = out[i++];
      h.assign(static_cast<std::size_t>(model.trunk_layers) + 1, in_place);
      branch.assign(static_cast<std::size_t>(model.trunk_layers), model.freeze_trunk_after > 0 ? out[i++] : nullptr);
    } else {
      for (int l = 0; l <= model.trunk_layers; ++l) { h.push_back(out[i++]); }
      for (int l = 0; l < model.trunk_layers; ++l) { branch.push_back(out[i++]); }
    }
    workspace_h = h;
    workspace_branch = branch;
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
    detail::initialise_homes(rt, model);
    initialised = true;
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

  // Forward and backward of one step; returns nothing, the losses land in losses[step·k + j]
  // for its k tasks. A streamed trunk acquires each layer for its forward (parameters alone) and
  // releases it, and again for its backward, stepped and released at once; the adapters come in
  // after the trunk's forward. The arithmetic is the same either way, so a streamed run equals a
  // held one bit for bit. Task j of the step takes rows [rows_begin(j), rows_begin(j + 1)).
  void train_step(std::int64_t step)
  {
    const std::vector<int> task = tasks_of_step(model, rank(), step);
    const int k = model.tasks_per_step;
    const int b = batch;
    const int d = model.width;
    const int layers = model.trunk_layers;
    const auto act = [this](int l) { return h[static_cast<std::size_t>(l)]; };
    const bool frozen = model.trunk_frozen(step);
    std::vector<taskswap::unit_id> adapter;
    adapter.reserve(task.size());
    for (const int t : task) { adapter.push_back(tasks[static_cast<std::size_t>(t)]); }
    std::vector<taskswap::unit_view> tv(trunk.size());
    std::vector<taskswap::unit_view> av(adapter.size());
    // Offloaded: the trunk's activations in blocks this step (none where the trunk is frozen).
    const bool offload = !blocks.empty() && !frozen;
    h = workspace_h;
    branch = workspace_branch;
    if (!streamed) {
      for (std::size_t l = 0; l < trunk.size(); ++l) {
        tv[l] = rt.acquire(trunk[l], compute, frozen ? taskswap::unit_use::frozen : taskswap::unit_use::train);
      }
      for (std::size_t j = 0; j < adapter.size(); ++j) { av[j] = rt.acquire(adapter[j], compute); }
    }

    // The batch and its targets: x random, y = x · A_task for each task's rows.
    kernels->random_uniform(
      act(0), static_cast<std::size_t>(b) * static_cast<std::size_t>(d),
      key_of(model.seed, key_input, static_cast<std::uint64_t>(rank()), static_cast<std::uint64_t>(step)), 1.0F);
    // The teacher: a part every task shares (what the trunk can learn once) plus the task's own.
    const std::size_t teacher_size = static_cast<std::size_t>(d) * static_cast<std::size_t>(model.outputs);
    const float scale = std::sqrt(3.0F / static_cast<float>(d));
    kernels->random_uniform(teacher, teacher_size, key_of(model.seed, key_teacher, 0, 0), scale);
    kernels->gemm(false, false, b, model.outputs, d, 1.0F, act(0), teacher, 0.0F, target);
    for (int j = 0; j < k; ++j) {
      kernels->random_uniform(
        teacher, teacher_size,
        key_of(model.seed, key_teacher, 1, static_cast<std::uint64_t>(task[static_cast<std::size_t>(j)])),
        0.5F * scale);
      const int r0 = rows_begin(b, k, j);
      kernels->gemm(false, false, rows_begin(b, k, j + 1) - r0, model.outputs, d, 1.0F, act(0) + row(r0, d), teacher,
                    1.0F, target + row(r0, model.outputs));
    }

    // Forward.
    for (int l = 0; l < layers; ++l) {
      const taskswap::unit_id u = trunk[static_cast<std::size_t>(l)];
      auto& v = tv[static_cast<std::size_t>(l)];
      if (streamed) { v = rt.acquire(u, compute, taskswap::unit_use::frozen); }
      if (offload) {  // its input kept in its block (two blocks held at once, not three)
        const taskswap::device_span input =
          rt.acquire(blocks[2 * static_cast<std::size_t>(l)], compute, taskswap::unit_use::stash)
            .param_tensor(0)
            .memory;
        taskswap::copy_async(input, in_workspace(act(l), input.size()), compute);
        branch[static_cast<std::size_t>(l)] = block(2 * l + 1, taskswap::unit_use::stash);
      }
      // A residual block: h_{l+1} = h_l + r_l, r_l = relu(h_l W_l + b_l).
      float* r = branch[static_cast<std::size_t>(l)];
      kernels->gemm(false, false, b, d, d, 1.0F, act(l), weight(v, 0, wide_weight), 0.0F, r);
      kernels->bias_activation(r, weight(v, 1, wide_bias), b, d, true);
      kernels->add(act(l + 1), act(l), r, static_cast<std::size_t>(b) * static_cast<std::size_t>(d));
      if (offload) { release_blocks(l); }
      if (streamed) { rt.release(u, compute); }
    }
    for (std::size_t j = 0; j < adapter.size(); ++j) {
      if (streamed) { av[j] = rt.acquire(adapter[j], compute); }
      const int r0 = rows_begin(b, k, static_cast<int>(j));
      adapter_pass(av[j], r0, rows_begin(b, k, static_cast<int>(j) + 1) - r0, step * k + static_cast<int>(j), frozen);
    }
    if (frozen) {  // the trunk takes no gradient: backward ends at the adapters
      if (!streamed) {
        for (auto it = trunk.rbegin(); it != trunk.rend(); ++it) { rt.release(*it, compute); }
      }
      last_stats = rt.end_step();
      return;
    }

    // Backward through the trunk, last layer first; each layer's update overlaps the rest. dh
    // holds dLoss/dh_{l+1}; the branch's gradient dr = dh masked by r_l > 0; then dh += dr W_l^T
    // is dLoss/dh_l (the skip path and the branch's).
    float* dh = back[1];
    float* dr = back[0];
    for (int l = layers - 1; l >= 0; --l) {
      auto& v = tv[static_cast<std::size_t>(l)];
      if (streamed) { v = rt.acquire(trunk[static_cast<std::size_t>(l)], compute); }
      if (offload) {
        h[static_cast<std::size_t>(l)] = block(2 * l, taskswap::unit_use::frozen);
        branch[static_cast<std::size_t>(l)] = block(2 * l + 1, taskswap::unit_use::frozen);
      }
      kernels->relu_backward(dr, dh, branch[static_cast<std::size_t>(l)],
                             static_cast<std::size_t>(b) * static_cast<std::size_t>(d));
      kernels->gemm(true, false, d, d, b, 1.0F, act(l), dr, 0.0F, grad_target(v, 0, wide_grad));
      store_grad(v, 0, wide_grad);
      kernels->column_sums(grad_target(v, 1, wide_bias_grad), dr, b, d, scratch);
      store_grad(v, 1, wide_bias_grad);
      if (l > 0) { kernels->gemm(false, true, b, d, d, 1.0F, dr, weight(v, 0, wide_weight), 1.0F, dh); }
      if (offload) { release_blocks(l); }
      finish(v.id);
    }
    last_stats = rt.end_step();
  }

  // The offset of row `r` of a row-major array of `width` columns.
  static std::size_t row(int r, int width) { return static_cast<std::size_t>(r) * static_cast<std::size_t>(width); }

  // One adapter over `n` rows from `r0`: forward, its loss (into losses[at]), its backward and
  // update; unless the trunk is frozen, dLoss/dh_L of those rows into back[1]'s.
  void adapter_pass(const taskswap::unit_view& av, int r0, int n, std::int64_t at, bool frozen)
  {
    const int d = model.width;
    const int hd = model.adapter_hidden;
    const int o = model.outputs;
    const float* x = h[static_cast<std::size_t>(model.trunk_layers)] + row(r0, d);
    float* hid = hidden + row(r0, hd);
    float* out = y + row(r0, o);
    float* dhid = back[0] + row(r0, std::max(d, hd));
    kernels->gemm(false, false, n, hd, d, 1.0F, x, weight(av, 0, wide_weight), 0.0F, hid);
    kernels->bias_activation(hid, weight(av, 1, wide_bias), n, hd, true);
    kernels->gemm(false, false, n, o, hd, 1.0F, hid, weight(av, 2, wide_weight), 0.0F, out);
    kernels->bias_activation(out, weight(av, 3, wide_bias), n, o, false);
    kernels->mse(out, target + row(r0, o), n, o, losses + at, scratch, loss_scale);

    // Backward through the adapter (out now holds dLoss/dy).
    kernels->gemm(true, false, hd, o, n, 1.0F, hid, out, 0.0F, grad_target(av, 2, wide_grad));
    store_grad(av, 2, wide_grad);
    kernels->column_sums(grad_target(av, 3, wide_bias_grad), out, n, o, scratch);
    store_grad(av, 3, wide_bias_grad);
    kernels->gemm(false, true, n, hd, o, 1.0F, out, weight(av, 2, wide_weight), 0.0F, dhid);
    kernels->relu_backward(dhid, dhid, hid, static_cast<std::size_t>(n) * static_cast<std::size_t>(hd));
    kernels->gemm(true, false, d, hd, n, 1.0F, x, dhid, 0.0F, grad_target(av, 0, wide_grad));
    store_grad(av, 0, wide_grad);
    kernels->column_sums(grad_target(av, 1, wide_bias_grad), dhid, n, hd, scratch);
    store_grad(av, 1, wide_bias_grad);
    if (!frozen) {
      kernels->gemm(false, true, n, d, hd, 1.0F, dhid, weight(av, 0, wide_weight), 0.0F, back[1] + row(r0, d));
    }
    finish(av.id);
  }

  [[nodiscard]] std::size_t per_step() const noexcept { return static_cast<std::size_t>(model.tasks_per_step); }

  // A run's interval of steps whose losses were copied home (a log line lags one interval: its
  // copy is read when the next one is queued).
  struct loss_interval {
    std::int64_t first;
    std::int64_t end;
    taskswap::event done;
    std::size_t reduced_bytes = 0;  // allreduced over the interval (with several ranks)
  };

  // The losses of steps [first, end) (each of its tasks') copied to losses_home on the compute stream.
  void copy_losses(std::int64_t first, std::int64_t end)
  {
    const std::size_t off = static_cast<std::size_t>(first) * per_step() * sizeof(float);
    const std::size_t n = static_cast<std::size_t>(end - first) * per_step() * sizeof(float);
    taskswap::copy_async(losses_home.span().subspan(off, n),
                         in_workspace(losses + static_cast<std::size_t>(first) * per_step(), n), compute);
  }

  [[nodiscard]] const float* host_losses() const
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): f32 array
    return reinterpret_cast<const float*>(losses_home.data());
  }

  // The log line of an interval (losses.cpp).
  [[nodiscard]] std::string interval_line(const loss_interval& p) const
  {
    p.done.synchronize();
    return detail::interval_line(model, rank(), world(), host_losses(), p.first, p.end, p.reduced_bytes);
  }

  // After the run's steps [begin, end_at): each task's losses and the step figures (losses.cpp).
  void summarise(run_result& r, std::int64_t begin, std::int64_t end_at)
  {
    r.tasks.resize(static_cast<std::size_t>(model.tasks));
    if (end_at == begin) { return; }
    copy_losses(begin, end_at);
    compute.synchronize();
    detail::summarise_losses(model, rank(), host_losses(), begin, end_at, r);
    detail::add_step_figures(rt, begin, r);
  }

  // Activation block `i` (layer i / 2's input, or its branch where i is odd) acquired for `use`: its rows.
  float* block(int i, taskswap::unit_use use)
  {
    return static_cast<float*>(rt.acquire(blocks[static_cast<std::size_t>(i)], compute, use).params.data);
  }
  // `bytes` of the workspace from `p` (in one of its buffers), as a device range.
  [[nodiscard]] taskswap::device_span in_workspace(const float* p, std::size_t bytes)
  {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a float's place in bytes
    const auto from = static_cast<std::size_t>(reinterpret_cast<const std::byte*>(p) - workspace.data());
    return workspace.span().subspan(from, bytes);
  }
  void release_blocks(int l)
  {
    rt.release(blocks[2 * static_cast<std::size_t>(l)], compute);
    rt.release(blocks[2 * static_cast<std::size_t>(l) + 1], compute);
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
      std::vector<taskswap::unit_id> adapters;
      for (const int t : tasks_of_step(model, rank(), s)) { adapters.push_back(tasks[static_cast<std::size_t>(t)]); }
      plans.push_back(step_plan_of(model, trunk, adapters, s, streamed, blocks));
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
  std::vector<taskswap::unit_id> blocks;  // offloaded activations: each layer's input, then its branch
  std::vector<float*> h;  // h_0 … h_L where the step has them: the workspace, or activation blocks
  std::vector<float*> branch;  // each trunk layer's r_l, whose sign the backward masks by
  std::vector<float*> workspace_h;  // h and branch in the workspace (with offloaded activations, one
  std::vector<float*> workspace_branch;  // h in place, and a frozen trunk's branch buffer, or null)
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
  const std::string k = entry("model.tasks_per_step");
  if (k != std::to_string(m.model.tasks_per_step) && !(k == "(none)" && m.model.tasks_per_step == 1)) {
    throw taskswap::checkpoint_error(
      "checkpoint '" + checkpoint.string() + "' was trained with [model] tasks_per_step = " + k + ", this run has " +
      std::to_string(m.model.tasks_per_step) + "; resume with the same (the task schedule depends on it)");
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
  const std::int64_t begin = m.first_step;
  std::int64_t end_at =
    options.stop_after >= 0 ? std::clamp<std::int64_t>(options.stop_after, begin, m.steps) : m.steps;
  const auto save = [&](std::int64_t done) {
    m.rt.save_checkpoint(options.checkpoint, {{"model.seed", std::to_string(m.model.seed)},
                                              {"model.tasks", std::to_string(m.model.tasks)},
                                              {"model.tasks_per_step", std::to_string(m.model.tasks_per_step)},
                                              {"steps_done", std::to_string(done)}});
  };
  m.planned_until = std::max(m.planned_until, begin);
  run_result r;
  const taskswap::disk_stats disk_before = m.rt.stats().disk;  // the initial values' writes are the set-up's
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::size_t interval_reduced = 0;
  std::optional<impl::loss_interval> waiting;
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
      m.copy_losses(first, s + 1);
      impl::loss_interval p{first, s + 1, taskswap::event(m.dev), interval_reduced};
      interval_reduced = 0;
      p.done.record(m.compute);
      if (waiting) { on_log(m.interval_line(*waiting)); }
      waiting = std::move(p);
    }
  }
  m.compute.synchronize();
  const auto end = std::chrono::steady_clock::now();
  if (waiting) { on_log(m.interval_line(*waiting)); }
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
  m.summarise(r, begin, end_at);
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
    for (std::size_t u = 0; u < m.rt.unit_count() - m.blocks.size(); ++u) {  // the model's units, not its activations
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
