// SPDX-License-Identifier: Apache-2.0
#include "device/message.hpp"

#include <array>
#include <cstdio>

namespace taskswap::detail {

std::string bytes_text(std::size_t bytes)
{
  static constexpr std::array<const char*, 5> units{"B", "KiB", "MiB", "GiB", "TiB"};
  auto value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < units.size()) {
    value /= 1024.0;
    ++unit;
  }
  std::array<char, 64> text{};
  if (unit == 0) {
    std::snprintf(text.data(), text.size(), "%zu B", bytes);
  } else {
    std::snprintf(text.data(), text.size(), "%.1f %s (%zu bytes)", value, units[unit], bytes);
  }
  return text.data();
}

}  // namespace taskswap::detail
