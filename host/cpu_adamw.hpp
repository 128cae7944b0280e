// SPDX-License-Identifier: Apache-2.0
#pragma once

// The CPU AdamW: one pass over a unit's flat slabs (fp32 master and moments; gradients in f32,
// bf16 or f16; optionally the compute-dtype parameter copy written in the same pass), vectorised
// with AVX-512 or AVX2 where the CPU has them, parallel over chunks in a host task arena. Results
// are bitwise independent of the instruction set and the thread count (see adamw_formula.hpp).

#include "host/adamw_formula.hpp"
#include "host/adamw_slabs.hpp"
#include "host/host_task_arena.hpp"

#include <cstddef>
#include <optional>
#include <string_view>

namespace taskswap::detail {

/// What is wrong with AdamW hyperparameters: the key ("lr", "eps", "weight_decay", "betas") and
/// what it must be. The config loader and the public cpu_adamw apply these rules.
struct adamw_option_problem {
  std::string_view key;
  std::string_view want;
};
[[nodiscard]] std::optional<adamw_option_problem> adamw_problem(const adamw_options& o) noexcept;

enum class cpu_isa { portable, avx2, avx512 };

[[nodiscard]] std::string_view to_string(cpu_isa isa) noexcept;

/// The widest instruction set this CPU supports among those compiled in.
[[nodiscard]] cpu_isa best_cpu_isa() noexcept;

/// Whether the streams of a pass over these slabs start staggered (host/stream_stagger.hpp): every
/// pairwise distance between the starts of master, m, v, the gradients and the parameter copy
/// scores at least 1 (stagger_score), as unit_layout places a unit's large slabs.
[[nodiscard]] bool staggered(const adamw_slabs& slabs) noexcept;

/// Whether a pass over these slabs writes its results through a tile buffer, each array's part
/// in one run (Note [Grouped stores] in cpu_adamw_kernel.hpp): for slabs of
/// stagger_min_array_bytes and more whose streams are not staggered (a caller's layout, which may
/// alias); staggered ones (the runtime's own units) run the plain loop, which is faster there.
[[nodiscard]] bool grouped_stores(const adamw_slabs& slabs) noexcept;

/// Updates elements [begin, end) on the calling thread with the given instruction set, its
/// stores grouped as grouped_stores(slabs) says (or as `grouped` says).
void cpu_adamw_range(const adamw_slabs& slabs, const adamw_scalars& scalars, std::size_t begin, std::size_t end,
                     cpu_isa isa);
void cpu_adamw_range(const adamw_slabs& slabs, const adamw_scalars& scalars, std::size_t begin, std::size_t end,
                     cpu_isa isa, bool grouped);

/// Updates every element, in parallel inside `arena`, with the best instruction set (or `isa`).
/// @throws invalid_argument for null slabs, a params copy in f32, or an ISA this CPU lacks
void cpu_adamw_step(const adamw_slabs& slabs, const adamw_scalars& scalars, host_task_arena& arena);
void cpu_adamw_step(const adamw_slabs& slabs, const adamw_scalars& scalars, host_task_arena& arena, cpu_isa isa);
/// As above with the stores grouped or not, whatever the slabs' size (tests, benchmarks).
void cpu_adamw_step(const adamw_slabs& slabs, const adamw_scalars& scalars, host_task_arena& arena, cpu_isa isa,
                    bool grouped);

}  // namespace taskswap::detail
