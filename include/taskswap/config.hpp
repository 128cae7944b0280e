// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief The TOML configuration (docs/configuration.md) and the device it names.

#include <taskswap/device.hpp>
#include <taskswap/runtime.hpp>

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace taskswap {

/// @brief Reads a configuration file.
/// @throws config_error naming the file, line and key: unknown keys, wrong types, unknown
/// policies, sizes without units; or a file that cannot be read
[[nodiscard]] runtime_options load_config(const std::filesystem::path& file);

/// @brief As above, skipping the top-level tables named in `own_tables`, which the application
/// reads itself (the sample trainer's [model]); any other unknown table is still an error.
[[nodiscard]] runtime_options load_config(const std::filesystem::path& file,
                                          std::span<const std::string_view> own_tables);

/// @brief The text of a configuration file, for applications that parse it themselves.
/// @throws config_error when the path does not exist, is a directory or another non-regular file
/// (a FIFO, a device), or cannot be read, saying which
[[nodiscard]] std::string read_config_file(const std::filesystem::path& file);

/// @brief Parses configuration text; `source` names it in error messages.
/// @throws config_error as load_config
[[nodiscard]] runtime_options parse_config(std::string_view text, std::string_view source = "config");

/// @brief As above, skipping the top-level tables named in `own_tables`.
[[nodiscard]] runtime_options parse_config(std::string_view text, std::string_view source,
                                           std::span<const std::string_view> own_tables);

/// @brief "40 GiB", "512 MiB", "1.5 GB", "4096 B" → bytes. A unit is required.
/// @throws config_error for anything else
[[nodiscard]] std::size_t parse_size(std::string_view text);

/// @brief The device `options` name: the CUDA device, or an emulated one whose memory is the
/// budget unless given.
/// @throws cuda_error, invalid_argument
[[nodiscard]] device make_device(const device_options& options);

}  // namespace taskswap
