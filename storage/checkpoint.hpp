// SPDX-License-Identifier: Apache-2.0
#pragma once

// The files of a checkpoint (include/taskswap/checkpoint.hpp): the manifest's text, data.bin,
// the temporary directory and the rename into place. The runtime supplies the slabs and applies
// what is read; the collective parts (with a communicator) are the runtime's.

#include <taskswap/checkpoint.hpp>
#include <taskswap/dtype.hpp>

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace taskswap::detail {

/// The manifest's `format` value and its file's name in a checkpoint directory.
inline constexpr std::string_view checkpoint_format = "taskswap-checkpoint";
inline constexpr std::string_view manifest_file = "manifest.toml";

/// The manifest's text.
[[nodiscard]] std::string manifest_text(const checkpoint_manifest& m);

/// Where a slab lies in a unit's home block (and in its unit file, laid out as the block).
struct home_range {
  std::size_t offset = 0;
  std::size_t bytes = 0;  // 0: the unit has no such slab
};

/// A unit's home slabs, as the runtime holds them: in host memory (`home`) or, for a disk home,
/// in its unit file (`file`, flushed: its bytes are the home's).
struct checkpoint_source {
  std::string name;
  dtype compute = dtype::f32;
  std::vector<std::pair<std::string, std::vector<std::size_t>>> tensors;  // name, shape
  std::int64_t step = 0;
  bool trainable = true;  // false: never trained; master, m and v are empty
  std::span<std::byte> home;  // a host home's block
  std::filesystem::path file;  // a disk home's unit file (then `home` is empty)
  home_range params;
  home_range master;  // empty when the compute dtype is f32 (the params are the master)
  home_range m;
  home_range v;
};

/// The manifest of `units`: host homes laid out in data.bin in order, disk homes each in a file
/// of its own in units/ (the unit file's name and layout), with every slab's checksum (a disk
/// home's read from its file).
/// @throws checkpoint_error when a unit file cannot be read
[[nodiscard]] checkpoint_manifest describe_checkpoint(std::span<const checkpoint_source> units);

/// Writes data.bin, the copies of the disk homes' unit files in units/ (clones where the file
/// system shares extents) and manifest.toml into a temporary directory beside `dir`, flushes them
/// and the directories, then renames it to `dir` (exchanging it with an existing checkpoint there,
/// which is then removed). On any failure `dir` is as it was and the temporary directory is gone.
/// @throws checkpoint_error naming the path and the system's reason
void write_checkpoint(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                      std::span<const checkpoint_source> units);

/// How copy_unit_file tries first: a clone (FICLONE), a copy inside the kernel (copy_file_range),
/// or through a buffer. Each falls back to the next where the call does not apply to the files.
enum class file_copy { clone, in_kernel, buffered };

/// Copies the unit file `from` to the new file `to` (which must not exist) and syncs it, trying
/// the ways from `first` on (write_checkpoint starts with the clone; tests force the others).
/// @throws checkpoint_error naming both paths and the system's reason
void copy_unit_file(const std::filesystem::path& from, const std::filesystem::path& to,
                    file_copy first = file_copy::clone);

/// Checks data.bin and the units' files against `manifest` (their sizes and every slab's checksum).
/// @throws checkpoint_error naming the first unit and slab that does not match
void verify_data(const std::filesystem::path& dir, const checkpoint_manifest& manifest);

/// Checks that the manifest's units are exactly `units` (names, compute dtypes, tensor names and
/// shapes, slab sizes), in any order; returns, for each of `units`, its index in the manifest.
/// @throws checkpoint_error naming the unit and what differs
[[nodiscard]] std::vector<std::size_t> match_units(const std::filesystem::path& dir,
                                                   const checkpoint_manifest& manifest,
                                                   std::span<const checkpoint_source> units);

/// Reads every slab into `units` (manifest index `where[i]` into units[i]): into a host home's
/// block, or written into a disk home's unit file (then synced), checking each checksum again as
/// it reads. Call after verify_checkpoint and match_units, with no transfer of those unit files in
/// flight (host_cache::discard).
/// @throws checkpoint_error if data.bin changed since it was verified
void read_checkpoint(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                     std::span<const checkpoint_source> units, std::span<const std::size_t> where);

}  // namespace taskswap::detail
