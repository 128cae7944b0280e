// SPDX-License-Identifier: Apache-2.0
#pragma once

// Building error messages: concatenation of anything streamable, and byte counts a person reads.

#include <cstddef>
#include <sstream>
#include <string>

namespace taskswap::detail {

/// Concatenates the arguments as an ostream would print them.
template <typename... Parts>
[[nodiscard]] std::string message(const Parts&... parts)
{
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

/// "3.2 GiB (3435973837 bytes)" style text: the binary unit a person reads, and the exact count.
[[nodiscard]] std::string bytes_text(std::size_t bytes);

}  // namespace taskswap::detail
