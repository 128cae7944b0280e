// SPDX-License-Identifier: Apache-2.0
// A user's program against the installed taskswap: a round trip through an emulated device, and
// one step of the public CPU AdamW checked against the formula.

#include <taskswap/taskswap.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

// AdamW's first step from zero moments moves each parameter by -lr * g / (|g| + eps) after the
// decay: -lr * sign(g) to within a relative 1e-5 here.
bool cpu_adamw_steps()
{
  taskswap::cpu_adamw opt({.threads = 1});
  std::vector<float> master(1000, 0.5F), m(1000), v(1000), g(1000);
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] = (i % 2 == 0 ? 1.0F : -1.0F) * 1e-2F * static_cast<float>(1 + i % 7);
  }
  const taskswap::adamw_options hyper{.lr = 1e-3, .weight_decay = 0.1};
  opt.step({master, m, v, g.data(), taskswap::dtype::f32}, hyper, 1);
  for (std::size_t i = 0; i < master.size(); ++i) {
    const double want = 0.5 * (1 - 1e-3 * 0.1) - 1e-3 * (g[i] > 0 ? 1 : -1);
    if (std::abs(master[i] - want) > 1e-5 * std::abs(want)) {
      std::printf("consumer: cpu_adamw gave %.9g at %zu, want %.9g\n", static_cast<double>(master[i]), i, want);
      return false;
    }
  }
  std::printf("consumer: cpu_adamw (%.*s) stepped %zu parameters\n", static_cast<int>(opt.instruction_set().size()),
              opt.instruction_set().data(), master.size());
  return true;
}

int main()
{
  const taskswap::device dev = taskswap::emulated_device({.memory_bytes = 1 << 20});
  taskswap::stream s(dev);
  taskswap::pinned_buffer in(dev, 1000);
  taskswap::pinned_buffer out(dev, 1000);
  for (std::size_t i = 0; i < in.size(); ++i) { in.data()[i] = static_cast<std::byte>(i * 7 + 3); }
  taskswap::device_buffer d(dev, 1000);
  taskswap::copy_async(d.span(), in.span(), s);
  taskswap::copy_async(out.span(), d.span(), s);
  s.synchronize();
  if (std::memcmp(in.data(), out.data(), in.size()) != 0) {
    std::puts("consumer: round trip differs");
    return 1;
  }
  std::printf("consumer: taskswap %s, round trip through %s ok\n", taskswap::get_build_info().version.c_str(),
              dev.name().c_str());
  return cpu_adamw_steps() ? 0 : 1;
}
