// SPDX-License-Identifier: Apache-2.0
#pragma once

// The files of a checkpoint (include/taskswap/checkpoint.hpp): the manifest's text, data.bin,
// the temporary directory and the rename into place. The runtime supplies the slabs and applies
// what is read; the collective parts (with a communicator) are the runtime's.

#include <taskswap/checkpoint.hpp>
#include <taskswap/runtime.hpp>

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace taskswap::detail {

/// A unit's home slabs, as the runtime holds them.
struct checkpoint_source {
  std::string name;
  dtype compute = dtype::f32;
  std::span<const tensor_info> tensors;
  std::int64_t step = 0;
  std::span<std::byte> params;
  std::span<std::byte> master;  // empty when the compute dtype is f32 (the params are the master)
  std::span<std::byte> m;
  std::span<std::byte> v;
  bool trainable = true;  // false: never trained; master, m and v are empty
};

/// The manifest of `units` laid out in data.bin in order, with every slab's checksum.
[[nodiscard]] checkpoint_manifest describe_checkpoint(std::span<const checkpoint_source> units);

/// The manifest's text.
[[nodiscard]] std::string manifest_text(const checkpoint_manifest& m);

/// Writes data.bin and manifest.toml into a temporary directory beside `dir`, flushes both and
/// the directory, then renames it to `dir` (exchanging it with an existing checkpoint there,
/// which is then removed). On any failure `dir` is as it was and the temporary directory is gone.
/// @throws checkpoint_error naming the path and the system's reason
void write_checkpoint(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                      std::span<const checkpoint_source> units);

/// Checks data.bin against `manifest` (its size and every slab's checksum).
/// @throws checkpoint_error naming the first unit and slab that does not match
void verify_data(const std::filesystem::path& dir, const checkpoint_manifest& manifest);

/// Checks that the manifest's units are exactly `units` (names, compute dtypes, tensor names and
/// shapes, slab sizes), in any order; returns, for each of `units`, its index in the manifest.
/// @throws checkpoint_error naming the unit and what differs
[[nodiscard]] std::vector<std::size_t> match_units(const std::filesystem::path& dir,
                                                   const checkpoint_manifest& manifest,
                                                   std::span<const checkpoint_source> units);

/// Reads every slab into `units` (manifest index `where[i]` into units[i]), checking each
/// checksum again as it reads. Call after verify_checkpoint and match_units.
/// @throws checkpoint_error if data.bin changed since it was verified
void read_checkpoint(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                     std::span<const checkpoint_source> units, std::span<const std::size_t> where);

}  // namespace taskswap::detail
