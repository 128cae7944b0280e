// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Checkpoints: what runtime::save_checkpoint writes and runtime::load_checkpoint reads.
///
/// A checkpoint is a directory holding `data.bin` (the home slabs of every unit whose home is in
/// host memory: params, the f32 master where the compute dtype is not f32, m, v), `units/` (a copy
/// of the unit file of every unit whose home is on disk, `[[units]] home = "disk"`: a clone where
/// the file system shares extents) and `manifest.toml` (the units, their tensors, dtypes and AdamW
/// step counts; each slab's file, offset, size and CRC-32C; the plan position; the optimizer
/// settings; the trainer's own entries). It is written into a temporary directory, flushed to the
/// disk, and renamed into place, so a directory named as the checkpoint is either the complete
/// old one or the complete new one; a partial one is refused at load.

#include <taskswap/dtype.hpp>
#include <taskswap/optimizer.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace taskswap {

/// @brief Where a slab lies in its unit's file (data.bin, or the unit's file in units/), and its checksum.
struct checkpoint_slab {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t crc32c = 0;
};

/// @brief One unit of a checkpoint.
struct checkpoint_unit {
  std::string name;
  dtype compute = dtype::f32;
  std::vector<std::pair<std::string, std::vector<std::size_t>>> tensors;  ///< name, shape
  std::int64_t step = 0;  ///< AdamW steps taken
  checkpoint_slab params;
  std::optional<checkpoint_slab> master;  ///< only when the compute dtype is not f32 and the unit is trainable
  checkpoint_slab m;
  checkpoint_slab v;
  bool trainable = true;  ///< false: a unit never trained (unit_spec::trainable), whose m and v are empty
  std::string file;  ///< empty: its slabs are in data.bin; else the name of its file in units/ (a disk home's copy)
};

/// @brief The loss scaler's state in a checkpoint (GradScaler.state_dict's scale and tracker).
struct checkpoint_scaler {
  double scale = 65536.0;
  std::int64_t growth_tracker = 0;
};

/// @brief The manifest of a checkpoint.
struct checkpoint_manifest {
  /// The newest version this reads. Version 2 added units' own files (`file`); a checkpoint
  /// without them is written as version 1, which older taskswap reads.
  static constexpr std::int64_t format_version = 2;
  std::string taskswap_version;
  std::uint64_t steps_done = 0;  ///< steps ended when it was saved: where the plan resumes
  int world = 1;  ///< ranks training together when it was saved
  std::uint64_t data_bytes = 0;  ///< the size of data.bin (the units without a file of their own)
  adamw_options optimizer{};  ///< the settings then (restored exactly: stored as hex floats)
  std::map<std::string, std::string> user;  ///< the trainer's entries
  std::vector<checkpoint_unit> units;
  std::optional<checkpoint_scaler> scaler{};  ///< when it was saved with a loss scaler
};

/// @brief Parses manifest text.
/// @param text the manifest (TOML)
/// @param source names it in errors Checks its structure (every key,
/// type and range, slabs inside data.bin and not overlapping), not the data.
/// @throws checkpoint_error naming the source, the line and what is wrong
[[nodiscard]] checkpoint_manifest parse_checkpoint_manifest(std::string_view text, std::string_view source);

/// @brief Reads `dir`/manifest.toml.
/// @param dir the checkpoint directory
/// @throws checkpoint_error when it is missing (an incomplete checkpoint) or invalid
[[nodiscard]] checkpoint_manifest read_checkpoint_manifest(const std::filesystem::path& dir);

/// @brief Checks `dir` completely: the manifest, the sizes of data.bin and the units' files, every
/// slab's checksum.
/// @param dir the checkpoint directory
/// @throws checkpoint_error naming the first unit and slab that does not match
void verify_checkpoint(const std::filesystem::path& dir);

}  // namespace taskswap
