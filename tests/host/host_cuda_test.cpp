// SPDX-License-Identifier: Apache-2.0
// The host layer on a CUDA device: PCI locality and cudaHostRegister in chunks.
#include "cuda_skip.hpp"
#include "round_trip.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace taskswap::test {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

class host_on_cuda : public ::testing::Test {
 protected:
  void SetUp() override
  {
    if (const std::string why = cuda_skip_reason(); !why.empty()) { GTEST_SKIP() << why; }
  }
};

TEST_F(host_on_cuda, LocalityComesFromThePciBusId)
{
  const device dev = cuda_device(0);
  const device_locality locality = locality_of(dev);
  ASSERT_FALSE(locality.numa_nodes.empty());
  EXPECT_FALSE(locality.cpus.empty());
  // hwloc in a container may lack PCI discovery; then the fallback must say why.
  if (locality.from_device) {
    EXPECT_NE(locality.source.find(dev.pci_bus_id()), std::string::npos) << locality.source;
  } else {
    EXPECT_NE(locality.source.find("fallback"), std::string::npos) << locality.source;
  }
}

// A copy may not span two cudaHostRegister ranges (cudaErrorInvalidValue): the arena is one range,
// so a slab across a prefault chunk's boundary copies like any other.
TEST_F(host_on_cuda, ArenaIsRegisteredAsOneRangeAndCopiesCrossChunkBoundaries)
{
  const device dev = cuda_device(0);
  pinned_arena arena(dev, {.bytes = 64 * MiB, .chunk_bytes = 16 * MiB});
  EXPECT_TRUE(arena.locked());
  EXPECT_EQ(arena.stats().pinned, arena.stats().reserved);
  // A slab that straddles the prefault chunk boundary at 16 MiB.
  auto filler = arena.allocate(12 * MiB);
  auto home = arena.allocate(10 * MiB + 3);
  auto back = arena.allocate(10 * MiB + 3);
  expect_round_trip(dev, home, back, 7);
  arena.deallocate(filler);
}

}  // namespace
}  // namespace taskswap::test
