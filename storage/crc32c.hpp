// SPDX-License-Identifier: Apache-2.0
#pragma once

// CRC-32C (Castagnoli), the checksum of every checkpoint slab: the SSE4.2 instruction where the
// CPU has it (about 10 GB/s a core), a slicing-by-8 table otherwise; the same values either way.

#include <cstddef>
#include <cstdint>
#include <span>

namespace taskswap::detail {

/// Extends `crc` (0 to start) over `data`.
[[nodiscard]] std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;

/// The table implementation (the reference of the tests).
[[nodiscard]] std::uint32_t crc32c_portable(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;

}  // namespace taskswap::detail
