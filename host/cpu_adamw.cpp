// SPDX-License-Identifier: Apache-2.0
#include "host/cpu_adamw.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"
#include "host/stream_stagger.hpp"

#include <cpuid.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>

namespace taskswap::detail {

// Defined in the per-instruction-set translation units.
// `grouped`: Note [Grouped stores] in cpu_adamw_kernel.hpp.
void cpu_adamw_range_portable(const adamw_slabs&, const adamw_scalars&, std::size_t, std::size_t, bool grouped);
void cpu_adamw_range_avx2(const adamw_slabs&, const adamw_scalars&, std::size_t, std::size_t, bool grouped);
void cpu_adamw_range_avx512(const adamw_slabs&, const adamw_scalars&, std::size_t, std::size_t, bool grouped);

std::optional<adamw_option_problem> adamw_problem(const adamw_options& o) noexcept
{
  if (!(o.lr > 0 && std::isfinite(o.lr))) { return adamw_option_problem{"lr", "must be a positive number"}; }
  if (!(o.eps > 0 && std::isfinite(o.eps))) { return adamw_option_problem{"eps", "must be a positive number"}; }
  if (!(o.weight_decay >= 0 && std::isfinite(o.weight_decay))) {
    return adamw_option_problem{"weight_decay", "must be 0 or more"};
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1)) {
    return adamw_option_problem{"betas", "each beta must be in [0, 1)"};
  }
  if (!(o.clip >= 0 && std::isfinite(o.clip))) {
    return adamw_option_problem{"clip", "must be 0 (no clipping) or more, e.g. clip = 1.0"};
  }
  return std::nullopt;
}

std::string_view to_string(cpu_isa isa) noexcept
{
  switch (isa) {
    case cpu_isa::avx512: return "avx512";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::portable: break;
  }
  return "portable";
}

namespace {
// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool has_f16c() noexcept
{
  unsigned eax = 0;
  unsigned ebx = 0;
  unsigned ecx = 0;
  unsigned edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1U << 29U)) != 0;
}

bool supports(cpu_isa isa) noexcept
{
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
  switch (isa) {
    case cpu_isa::avx512: return avx2 && __builtin_cpu_supports("avx512f");
    case cpu_isa::avx2: return avx2;
    case cpu_isa::portable: break;
  }
  return true;
}

// Elements per parallel chunk: a multiple of every vector width, large enough to amortise the
// task, small enough to balance two to a few dozen threads.
constexpr std::size_t chunk_elements = std::size_t{1} << 16;
}  // namespace

cpu_isa best_cpu_isa() noexcept
{
  static const cpu_isa best = supports(cpu_isa::avx512) ? cpu_isa::avx512
                              : supports(cpu_isa::avx2) ? cpu_isa::avx2
                                                        : cpu_isa::portable;
  return best;
}

bool staggered(const adamw_slabs& slabs) noexcept
{
  const std::array<const void*, 5> starts{slabs.master, slabs.m, slabs.v, slabs.grad, slabs.params};
  for (std::size_t a = 0; a < starts.size(); ++a) {
    for (std::size_t b = a + 1; b < starts.size(); ++b) {
      if (starts[a] == nullptr || starts[b] == nullptr) { continue; }
      const auto x =
        reinterpret_cast<std::uintptr_t>(starts[a]);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
      const auto y =
        reinterpret_cast<std::uintptr_t>(starts[b]);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
      if (stagger_score(x > y ? x - y : y - x) < 1.0) { return false; }
    }
  }
  return true;
}

bool grouped_stores(const adamw_slabs& slabs) noexcept
{
  return slabs.count * sizeof(float) >= stagger_min_array_bytes && !staggered(slabs);
}

void cpu_adamw_range(const adamw_slabs& slabs, const adamw_scalars& scalars, std::size_t begin, std::size_t end,
                     cpu_isa isa)
{
  cpu_adamw_range(slabs, scalars, begin, end, isa, grouped_stores(slabs));
}

void cpu_adamw_range(const adamw_slabs& slabs, const adamw_scalars& scalars, std::size_t begin, std::size_t end,
                     cpu_isa isa, bool grouped)
{
  switch (isa) {
    case cpu_isa::avx512: cpu_adamw_range_avx512(slabs, scalars, begin, end, grouped); return;
    case cpu_isa::avx2: cpu_adamw_range_avx2(slabs, scalars, begin, end, grouped); return;
    case cpu_isa::portable: cpu_adamw_range_portable(slabs, scalars, begin, end, grouped); return;
  }
}

void cpu_adamw_step(const adamw_slabs& slabs, const adamw_scalars& scalars, host_task_arena& arena)
{
  cpu_adamw_step(slabs, scalars, arena, best_cpu_isa());
}

void cpu_adamw_step(const adamw_slabs& slabs, const adamw_scalars& scalars, host_task_arena& arena, cpu_isa isa)
{
  cpu_adamw_step(slabs, scalars, arena, isa, grouped_stores(slabs));
}

void cpu_adamw_step(const adamw_slabs& slabs, const adamw_scalars& scalars, host_task_arena& arena, cpu_isa isa,
                    bool grouped)
{
  if (slabs.count == 0) { return; }
  TASKSWAP_EXPECTS(slabs.master != nullptr && slabs.m != nullptr && slabs.v != nullptr && slabs.grad != nullptr,
                   message("AdamW on ", slabs.count, " elements needs master, m, v and gradient slabs"));
  TASKSWAP_EXPECTS(is_floating(slabs.grad_type) && is_floating(slabs.param_type),
                   "AdamW: the gradients and parameters are f32, bf16 or f16 (u8 is a frozen unit's raw bytes)");
  TASKSWAP_EXPECTS(slabs.params == nullptr || slabs.param_type != dtype::f32,
                   "AdamW: an f32 compute dtype updates the master in place; pass no params copy");
  TASKSWAP_EXPECTS(supports(isa), message("AdamW: this CPU lacks the ", to_string(isa), " instruction set"));
  const std::size_t chunks = (slabs.count + chunk_elements - 1) / chunk_elements;
  arena.parallel_for(chunks, [&](std::size_t first, std::size_t last) {
    cpu_adamw_range(slabs, scalars, first * chunk_elements, std::min(slabs.count, last * chunk_elements), isa, grouped);
  });
}

}  // namespace taskswap::detail
