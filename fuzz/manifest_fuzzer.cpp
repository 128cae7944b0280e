// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for the checkpoint manifest reader: any text either parses into a manifest
// whose slabs lie inside data.bin without overlapping, or is refused with a checkpoint_error.
// A manifest that parses is written back and read again: the same manifest (the writer and the
// reader agree on every field, the optimizer's settings to the bit).

#include "storage/checkpoint.hpp"

#include <taskswap/checkpoint.hpp>
#include <taskswap/error.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace {

bool same(const taskswap::checkpoint_slab& a, const taskswap::checkpoint_slab& b)
{
  return a.offset == b.offset && a.bytes == b.bytes && a.crc32c == b.crc32c;
}

bool same(const taskswap::checkpoint_manifest& a, const taskswap::checkpoint_manifest& b)
{
  const auto bits = [](double d) { return std::bit_cast<std::uint64_t>(d); };
  if (a.steps_done != b.steps_done || a.world != b.world || a.data_bytes != b.data_bytes || a.user != b.user ||
      a.taskswap_version != b.taskswap_version || a.units.size() != b.units.size() ||
      bits(a.optimizer.lr) != bits(b.optimizer.lr) || bits(a.optimizer.beta1) != bits(b.optimizer.beta1) ||
      bits(a.optimizer.beta2) != bits(b.optimizer.beta2) || bits(a.optimizer.eps) != bits(b.optimizer.eps) ||
      bits(a.optimizer.weight_decay) != bits(b.optimizer.weight_decay)) {
    return false;
  }
  for (std::size_t i = 0; i < a.units.size(); ++i) {
    const auto& x = a.units[i];
    const auto& y = b.units[i];
    if (x.name != y.name || x.compute != y.compute || x.tensors != y.tensors || x.step != y.step ||
        !same(x.params, y.params) || !same(x.m, y.m) || !same(x.v, y.v) ||
        x.master.has_value() != y.master.has_value() || (x.master && !same(*x.master, *y.master))) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): bytes as text
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  taskswap::checkpoint_manifest m;
  try {
    m = taskswap::parse_checkpoint_manifest(text, "fuzz/manifest.toml");
  } catch (const taskswap::checkpoint_error&) {
    return 0;
  }
  const std::string again = taskswap::detail::manifest_text(m);
  if (!same(taskswap::parse_checkpoint_manifest(again, "rewritten"), m)) { __builtin_trap(); }
  return 0;
}
