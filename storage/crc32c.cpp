// SPDX-License-Identifier: Apache-2.0
#include "storage/crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace taskswap::detail {
namespace {

constexpr std::uint32_t polynomial = 0x82f63b78U;  // reflected Castagnoli

constexpr std::array<std::array<std::uint32_t, 256>, 8> make_tables()
{
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) { c = (c & 1U) != 0 ? (c >> 1U) ^ polynomial : c >> 1U; }
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t i = 0; i < 256; ++i) { t[k][i] = (t[k - 1][i] >> 8U) ^ t[0][t[k - 1][i] & 0xffU]; }
  }
  return t;
}

constexpr auto tables = make_tables();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::span<const std::byte> data,
                                                             std::uint32_t crc) noexcept
{
  std::uint64_t c = ~crc;
  const std::byte* p = data.data();
  std::size_t n = data.size();
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) { c32 = _mm_crc32_u8(c32, static_cast<std::uint8_t>(*p)); }
  return ~c32;
}
#endif

}  // namespace

std::uint32_t crc32c_portable(std::span<const std::byte> data, std::uint32_t crc) noexcept
{
  std::uint32_t c = ~crc;
  const std::byte* p = data.data();
  std::size_t n = data.size();
  for (; n >= 8; n -= 8, p += 8) {
    std::uint32_t lo = 0;
    std::uint32_t hi = 0;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = tables[7][lo & 0xffU] ^ tables[6][(lo >> 8U) & 0xffU] ^ tables[5][(lo >> 16U) & 0xffU] ^ tables[4][lo >> 24U] ^
        tables[3][hi & 0xffU] ^ tables[2][(hi >> 8U) & 0xffU] ^ tables[1][(hi >> 16U) & 0xffU] ^ tables[0][hi >> 24U];
  }
  for (; n > 0; --n, ++p) { c = (c >> 8U) ^ tables[0][(c ^ static_cast<std::uint32_t>(*p)) & 0xffU]; }
  return ~c;
}

std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc) noexcept
{
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2") != 0;
  if (hardware) { return crc32c_sse42(data, crc); }
#endif
  return crc32c_portable(data, crc);
}

}  // namespace taskswap::detail
