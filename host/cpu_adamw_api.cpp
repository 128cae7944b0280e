// SPDX-License-Identifier: Apache-2.0
// The public CPU AdamW (taskswap/cpu_adamw.hpp): checks, then the runtime's own cpu_adamw_step.
#include <taskswap/cpu_adamw.hpp>

#include "device/expects.hpp"
#include "device/log.hpp"
#include "device/message.hpp"
#include "host/cpu_adamw.hpp"
#include "host/host_task_arena.hpp"
#include "host/stream_stagger.hpp"

#include <taskswap/error.hpp>

#include <array>
#include <cstdint>
#include <utility>

namespace taskswap {

std::string adamw_options_problem(const adamw_options& o)
{
  const auto p = detail::adamw_problem(o);
  if (!p) { return {}; }
  if (p->key == "betas") { return detail::message("betas are (", o.beta1, ", ", o.beta2, "): ", p->want); }
  const double value = p->key == "lr" ? o.lr : p->key == "eps" ? o.eps : o.weight_decay;
  return detail::message(p->key, " is ", value, ": ", p->want);
}

struct cpu_adamw::impl {
  impl(int numa_node, int threads) : arena(numa_node, threads) {}
  detail::host_task_arena arena;
};

namespace {

struct operand {
  const char* name;
  std::uintptr_t begin;
  std::size_t bytes;
};

// Arrays within 12 KiB of a multiple of 128 MiB apart ran at 0.33-0.87 of the speed of separately
// mapped ones on the development VM (host/stream_stagger.hpp); the warning says so once per process.
void warn_if_aliased(const std::array<operand, 5>& ops, std::size_t used)
{
  constexpr std::size_t period = std::size_t{128} << 20;
  for (std::size_t i = 0; i < used; ++i) {
    for (std::size_t j = i + 1; j < used; ++j) {
      const std::uintptr_t a = ops[i].begin;
      const std::uintptr_t b = ops[j].begin;
      const std::size_t d = a > b ? a - b : b - a;
      const std::size_t r = std::min(d % period, period - d % period);
      if (d >= period && r < detail::stagger_min_gap) {
        detail::log_once(
          "cpu-adamw-alias", log_level::warning,
          detail::message("cpu_adamw: ", ops[i].name, " and ", ops[j].name, " start ", detail::bytes_text(d),
                          " apart; arrays (nearly) a multiple of 128 MiB apart ran the step at 0.33-0.87 of "
                          "the speed of separate ones on a test machine. Allocate them separately or start "
                          "each 12.75 KiB further into a 64 KiB period (docs/host.md#array-layout)"));
        return;
      }
    }
  }
}

}  // namespace

cpu_adamw::cpu_adamw(cpu_adamw_options options)
{
  TASKSWAP_EXPECTS(options.threads >= 0,
                   detail::message("cpu_adamw: threads is ", options.threads, "; give 0 (every CPU) or more"));
  TASKSWAP_EXPECTS(options.numa_node >= -1, detail::message("cpu_adamw: numa_node is ", options.numa_node,
                                                            "; give -1 (none) or a node's OS index"));
  impl_ = std::make_unique<impl>(options.numa_node, options.threads);
}

cpu_adamw::~cpu_adamw() = default;
cpu_adamw::cpu_adamw(cpu_adamw&&) noexcept = default;
cpu_adamw& cpu_adamw::operator=(cpu_adamw&&) noexcept = default;

int cpu_adamw::threads() const { return impl_->arena.concurrency(); }

std::string_view cpu_adamw::instruction_set() const noexcept { return detail::to_string(detail::best_cpu_isa()); }

void cpu_adamw::step(const adamw_tensors& t, const adamw_options& hyper, std::int64_t step)
{
  if (const std::string problem = adamw_options_problem(hyper); !problem.empty()) {
    throw config_error("cpu_adamw: " + problem);
  }
  const std::size_t n = t.master.size();
  TASKSWAP_EXPECTS(step >= 1, detail::message("cpu_adamw: step is ", step, "; the first update of a tensor is step 1"));
  TASKSWAP_EXPECTS(t.m.size() == n && t.v.size() == n,
                   detail::message("cpu_adamw: master has ", n, " elements but m has ", t.m.size(), " and v ",
                                   t.v.size(), "; give each as many"));
  if (n == 0) { return; }
  TASKSWAP_EXPECTS(t.grad != nullptr, "cpu_adamw: no gradients; point grad at master.size() values of grad_type");
  TASKSWAP_EXPECTS(is_floating(t.grad_type) && is_floating(t.param_type),
                   "cpu_adamw: grad_type and param_type are f32, bf16 or f16 (u8 is a frozen unit's raw bytes)");
  TASKSWAP_EXPECTS(t.params == nullptr || t.param_type != dtype::f32,
                   "cpu_adamw: an f32 params copy would be the master itself; pass params = nullptr for f32 training");
  const std::size_t g = size_of(t.grad_type);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): address arithmetic
  const auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  TASKSWAP_EXPECTS(addr(t.grad) % g == 0,
                   detail::message("cpu_adamw: grad is not aligned to its ", g, "-byte elements"));
  TASKSWAP_EXPECTS(t.params == nullptr || addr(t.params) % 2 == 0, "cpu_adamw: params is not aligned to 2 bytes");
  std::array<operand, 5> ops{{{"master", addr(t.master.data()), n * 4},
                              {"m", addr(t.m.data()), n * 4},
                              {"v", addr(t.v.data()), n * 4},
                              {"grad", addr(t.grad), n * g},
                              {"params", addr(t.params), t.params != nullptr ? n * 2 : 0}}};
  const std::size_t used = t.params != nullptr ? 5 : 4;
  for (std::size_t i = 0; i < used; ++i) {
    for (std::size_t j = i + 1; j < used; ++j) {
      const bool apart = ops[i].begin + ops[i].bytes <= ops[j].begin || ops[j].begin + ops[j].bytes <= ops[i].begin;
      TASKSWAP_EXPECTS(
        apart, detail::message("cpu_adamw: ", ops[i].name, " and ", ops[j].name, " overlap; give each its own memory"));
    }
  }
  if (n * 4 >= detail::stagger_min_array_bytes) { warn_if_aliased(ops, used); }
  const detail::adamw_slabs slabs{t.master.data(), t.m.data(), t.v.data(),   t.grad,
                                  t.grad_type,     t.params,   t.param_type, n};
  detail::cpu_adamw_step(slabs, detail::make_adamw_scalars(hyper, step), impl_->arena);
}

}  // namespace taskswap
