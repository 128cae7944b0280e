// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for the configuration loader: any text either parses into options or is
// refused with a config_error; nothing else may escape (no crash, no other exception, no
// sanitizer report, no hang). Sizes and durations go through parse_size too.

#include <taskswap/config.hpp>
#include <taskswap/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): bytes as text
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const taskswap::runtime_options o = taskswap::parse_config(text, "fuzz.toml");
    if (o.device.budget == 0) { __builtin_trap(); }  // the loader promises a budget
  } catch (const taskswap::config_error&) {}
  // The loader with an application's own table skipped (as the sample trainer reads [model]).
  static constexpr std::array<std::string_view, 1> own{"model"};
  try {
    (void)taskswap::parse_config(text, "fuzz.toml", own);
  } catch (const taskswap::config_error&) {}
  try {
    (void)taskswap::parse_size(text.substr(0, 64));
  } catch (const taskswap::config_error&) {}
  return 0;
}
