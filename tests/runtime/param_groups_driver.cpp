// SPDX-License-Identifier: Apache-2.0
// Trains three units with param groups on the emulated device and writes their final f32 masters,
// for param_groups_vs_torch.py, which runs torch.optim.AdamW on the same gradients:
//   trunk/0 {w [16, 8], b [8] no_weight_decay}, task/0 and task/1 {w [8, 4], b [4] no_weight_decay};
//   [[units]] task/* lr_scale = 10, [[units]] task/1 weight_decay = 0; step k trains the trunk and
//   task/(k % 2), whose gradients task/(k % 2) accumulates over `micro` micro-batches.
//
// With CLIP, INIT_SCALE and INF_STEPS the steps are guarded: [optimizer] clip = CLIP (0: none), a
// loss scaler from INIT_SCALE (0: none; growth_interval 3), the gradients multiplied by the
// device's loss scale as a trainer's loss is, and at each step of INF_STEPS (comma-separated, or
// "-") element 3 of the task's gradient is +inf. Then the scaler's state follows the masters:
// scale, growth tracker, skipped steps (as floats), and for each step its global gradient norm
// (unscaled), the scale after it and whether it was skipped (1 or 0), as floats. Under mpirun with TASKSWAP_TEST_MPI=1 the ranks
// reduce over MPI and only the last rank injects the inf; each rank writes OUT.rank. With
// TASKSWAP_TEST_COMPUTE=f16 the units compute (and keep gradients) in f16.
//
//   param_groups_driver OUT STEPS device|host MICRO [CLIP INIT_SCALE INF_STEPS]

#include <taskswap/taskswap.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
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
// Multiples of 1/8 times 1, 2 or 4 by step: exact in f16, and global norms that differ by step (so
// that a clipping threshold between them binds on some steps only).
float gradient(std::uint32_t u, std::size_t i, int step, int micro)
{
  const float by = static_cast<float>(1 << (step % 3));
  return (static_cast<float>((i * 7 + static_cast<std::size_t>(step) * 3 + u * 5 + static_cast<std::size_t>(micro)) %
                             11) *
            0.125F -
          0.625F) *
         by;
}

// The f16 bits of x, which must be a normal half or zero exactly (the gradients here are).
std::uint16_t half_bits(float x)
{
  if (x == 0.0F) { return 0; }
  int e = 0;
  const float m = std::frexp(std::fabs(x), &e);  // x = m * 2^e, m in [0.5, 1)
  const float mantissa = std::ldexp(m, 11) - 1024.0F;  // 10 bits below the leading one
  const int biased = e - 1 + 15;
  if (biased < 1 || biased > 30 || mantissa != std::floor(mantissa)) {
    throw std::runtime_error("param_groups_driver: " + std::to_string(x) + " is not exact in f16");
  }
  return static_cast<std::uint16_t>((x < 0 ? 0x8000U : 0U) | (static_cast<unsigned>(biased) << 10U) |
                                    static_cast<unsigned>(mantissa));
}

float half_value(std::uint16_t h)
{
  const int biased = (h >> 10U) & 0x1F;
  const float magnitude = biased == 0 ? std::ldexp(static_cast<float>(h & 0x3FFU), -24)
                                      : std::ldexp(static_cast<float>((h & 0x3FFU) | 0x400U), biased - 25);
  return (h & 0x8000U) != 0 ? -magnitude : magnitude;
}

}  // namespace

int main(int argc, char** argv)
{
  if (argc != 5 && argc != 8) {
    std::fprintf(stderr, "usage: param_groups_driver OUT STEPS device|host MICRO [CLIP INIT_SCALE INF_STEPS]\n");
    return 2;
  }
  std::string out = argv[1];
  const int steps = std::stoi(argv[2]);
  const std::string placement = argv[3];
  const int micro = std::stoi(argv[4]);
  const bool guarded = argc == 8;
  std::vector<int> inf_steps;
  if (guarded && std::string(argv[7]) != "-") {
    std::string list = argv[7];
    for (std::size_t at = 0; at < list.size();) {
      const std::size_t comma = std::min(list.find(',', at), list.size());
      inf_steps.push_back(std::stoi(list.substr(at, comma - at)));
      at = comma + 1;
    }
  }
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
)",
                                                         "param_groups_driver");
    o.defaults.optimizer =
      placement == "host" ? taskswap::optimizer_placement::host : taskswap::optimizer_placement::device;
    if (guarded) {
      o.optimizer.clip = std::stod(argv[5]);
      o.scaler.init_scale = std::stod(argv[6]);
      o.scaler.enabled = o.scaler.init_scale > 0;
      o.scaler.growth_interval = 3;
    }
    const char* mpi = std::getenv("TASKSWAP_TEST_MPI");
    if (mpi != nullptr && std::string(mpi) == "1") { o.comm.backend = taskswap::comm_backend::mpi; }
    const char* compute = std::getenv("TASKSWAP_TEST_COMPUTE");
    const bool f16 = compute != nullptr && std::string(compute) == "f16";
    const auto unit = [f16](std::string name, std::size_t rows, std::size_t cols) {
      taskswap::unit_spec u;
      u.name = std::move(name);
      u.tensors = {{"w", {rows, cols}}, {"b", {cols}, true}};
      u.compute = f16 ? taskswap::dtype::f16 : taskswap::dtype::f32;
      return u;
    };
    const taskswap::device dev = taskswap::make_device(o.device);
    taskswap::runtime rt(dev, o, {unit("trunk/0", 16, 8), unit("task/0", 8, 4), unit("task/1", 8, 4)});
    for (std::uint32_t u = 0; u < 3; ++u) {
      const taskswap::home_view h = rt.home(taskswap::unit_id{u});
      for (const taskswap::tensor_info& t : h.tensors) {
        for (std::size_t i = 0; i < t.count; ++i) {
          static_cast<float*>(h.master.data)[t.offset + i] = initial(u, t.offset + i);
        }
      }
    }
    taskswap::stream s(dev);
    const bool last_rank = rt.rank() == rt.world_size() - 1;
    if (rt.world_size() > 1) {
      out += '.';
      out += std::to_string(rt.rank());
    }
    const float* scale = o.scaler.enabled ? rt.loss_scale() : nullptr;
    std::vector<float> per_step;  // guarded: norm, scale after, skipped; per step
    for (int k = 0; k < steps; ++k) {
      const bool inf = last_rank && std::find(inf_steps.begin(), inf_steps.end(), k) != inf_steps.end();
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
            const bool poison = inf && u.value != 0 && ti == 0 && m == 0;
            taskswap::launch_host_func(s, [g, offset, u, k, m, scale, poison] {
              // d(scale * loss) / d(theta): the device's scale as the step's loss kernel reads it
              const float by = scale != nullptr ? *scale : 1.0F;
              if (g.type == taskswap::dtype::f16) {
                std::uint16_t* h = g.data<std::uint16_t>();
                for (std::size_t i = 0; i < g.count; ++i) {
                  h[i] = half_bits(half_value(h[i]) + gradient(u.value, offset + i, k, m) * by);
                }
                if (poison) { h[3] = 0x7C00U; }  // +inf
                return;
              }
              for (std::size_t i = 0; i < g.count; ++i) {
                g.data<float>()[i] += gradient(u.value, offset + i, k, m) * by;
              }
              if (poison) { g.data<float>()[3] = std::numeric_limits<float>::infinity(); }
            });
          }
        }
        rt.grads_ready(u, s);
        rt.step(u, s);
        rt.release(u, s);
      }
      (void)rt.end_step();
      if (guarded) {  // synchronises: the step's figures, read back as a test may
        const taskswap::loss_scaler_state st = rt.scaler_state();
        per_step.insert(per_step.end(), {st.last_norm, st.scale, st.last_skipped ? 1.0F : 0.0F});
      }
    }
    rt.flush();
    std::ofstream f(out, std::ios::binary | std::ios::trunc);
    for (std::uint32_t u = 0; u < 3; ++u) {
      const taskswap::home_view h = rt.home(taskswap::unit_id{u});
      for (const taskswap::tensor_info& t : h.tensors) {
        f.write(static_cast<const char*>(h.master.data) + t.offset * sizeof(float),
                static_cast<std::streamsize>(t.count * sizeof(float)));
      }
    }
    if (guarded) {
      const taskswap::loss_scaler_state st = rt.scaler_state();
      const float tail[3] = {st.scale, static_cast<float>(st.growth_tracker), static_cast<float>(st.skipped_steps)};
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the floats' bytes
      f.write(reinterpret_cast<const char*>(tail), sizeof tail);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the floats' bytes
      f.write(reinterpret_cast<const char*>(per_step.data()),
              static_cast<std::streamsize>(per_step.size() * sizeof(float)));
    }
    if (!f.flush()) { throw std::runtime_error("cannot write " + out); }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "param_groups_driver: %s\n", e.what());
    return 1;
  }
  return 0;
}
