// SPDX-License-Identifier: Apache-2.0
// Trains three units with param groups on the emulated device and writes their final f32 masters,
// for param_groups_vs_torch.py, which runs torch.optim.AdamW on the same gradients:
//   trunk/0 {w [16, 8], b [8] no_weight_decay}, task/0 and task/1 {w [8, 4], b [4] no_weight_decay};
//   [[units]] task/* lr_scale = 10, [[units]] task/1 weight_decay = 0; step k trains the trunk and
//   task/(k % 2), whose gradients task/(k % 2) accumulates over `micro` micro-batches.
//
//   param_groups_driver OUT STEPS device|host MICRO

#include <taskswap/taskswap.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <fstream>
#include <string>
#include <vector>

namespace {

// The formulas param_groups_vs_torch.py repeats; the gradients are multiples of 1/8, exact in f32
// and in their sums, and both sides round the initial values the same way.
float initial(std::uint32_t u, std::size_t i) { return static_cast<float>((i * 13 + u * 3) % 17) * 0.01F - 0.08F; }
float gradient(std::uint32_t u, std::size_t i, int step, int micro)
{
  return static_cast<float>((i * 7 + static_cast<std::size_t>(step) * 3 + u * 5 + static_cast<std::size_t>(micro)) % 11) *
           0.125F - 0.625F;
}

}  // namespace

int main(int argc, char** argv)
{
  if (argc != 5) {
    std::fprintf(stderr, "usage: param_groups_driver OUT STEPS device|host MICRO\n");
    return 2;
  }
  const std::string out = argv[1];
  const int steps = std::stoi(argv[2]);
  const std::string placement = argv[3];
  const int micro = std::stoi(argv[4]);
  try {
    taskswap::runtime_options o = taskswap::parse_config(R"(
[device]
backend = "emulated"
budget = "1 MiB"
[defaults]
residency = "on_demand"
[optimizer]
lr = 1e-2
weight_decay = 0.1
[[units]]
match = "task/*"
lr_scale = 10.0
[[units]]
match = "task/1"
weight_decay = 0.0
)", "param_groups_driver");
    o.defaults.optimizer = placement == "host" ? taskswap::optimizer_placement::host : taskswap::optimizer_placement::device;
    const auto unit = [](std::string name, std::size_t rows, std::size_t cols) {
      taskswap::unit_spec u;
      u.name = std::move(name);
      u.tensors = {{"w", {rows, cols}}, {"b", {cols}, true}};
      return u;
    };
    const taskswap::device dev = taskswap::make_device(o.device);
    taskswap::runtime rt(dev, o, {unit("trunk/0", 16, 8), unit("task/0", 8, 4), unit("task/1", 8, 4)});
    for (std::uint32_t u = 0; u < 3; ++u) {
      const taskswap::home_view h = rt.home(taskswap::unit_id{u});
      for (const taskswap::tensor_info& t : h.tensors) {
        for (std::size_t i = 0; i < t.count; ++i) { static_cast<float*>(h.master.data)[t.offset + i] = initial(u, t.offset + i); }
      }
    }
    taskswap::stream s(dev);
    for (int k = 0; k < steps; ++k) {
      const taskswap::unit_id trunk{0};
      const taskswap::unit_id task{static_cast<std::uint32_t>(1 + k % 2)};
      rt.plan(taskswap::step_plan{trunk, task});
      for (const taskswap::unit_id u : {trunk, task}) {
        const taskswap::unit_view v = rt.acquire(u, s);
        // Gradient accumulation: `micro` backward passes add into the slab before grads_ready.
        for (int m = 0; m < micro; ++m) {
          for (std::size_t ti = 0; ti < v.tensors.size(); ++ti) {
            const taskswap::tensor_view g = v.grad_tensor(ti);
            const std::size_t offset = v.tensors[ti].offset;
            taskswap::launch_host_func(s, [g, offset, u, k, m] {
              for (std::size_t i = 0; i < g.count; ++i) { g.data<float>()[i] += gradient(u.value, offset + i, k, m); }
            });
          }
        }
        rt.grads_ready(u, s);
        rt.step(u, s);
        rt.release(u, s);
      }
      (void)rt.end_step();
    }
    rt.flush();
    std::ofstream f(out, std::ios::binary | std::ios::trunc);
    for (std::uint32_t u = 0; u < 3; ++u) {
      const taskswap::home_view h = rt.home(taskswap::unit_id{u});
      for (const taskswap::tensor_info& t : h.tensors) {
        f.write(static_cast<const char*>(h.master.data) + t.offset * sizeof(float), static_cast<std::streamsize>(t.count * sizeof(float)));
      }
    }
    if (!f.flush()) { throw std::runtime_error("cannot write " + out); }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "param_groups_driver: %s\n", e.what());
    return 1;
  }
  return 0;
}
