// SPDX-License-Identifier: Apache-2.0
#pragma once

// A fresh random seed for a test, or the one TASKSWAP_TEST_SEED names (to replay a failure). A
// test that draws from it prints it (SCOPED_TRACE) so that a failure says how to replay it.

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace taskswap::test {

inline std::uint64_t test_seed()
{
  if (const char* fixed = std::getenv("TASKSWAP_TEST_SEED"); fixed != nullptr && *fixed != '\0') {
    return std::stoull(fixed);
  }
  std::random_device device;
  return (std::uint64_t{device()} << 32) ^ device();
}

}  // namespace taskswap::test
