// SPDX-License-Identifier: Apache-2.0
// NCCL is loaded at run time, never at link time (Note [NCCL at run time], comm/nccl_library.hpp):
// nothing loads libnccl.so.2 before taskswap first needs it, and then the table is complete. Runs
// without a GPU: loading NCCL and asking its version need no device.

#include "comm/nccl_library.hpp"

#include <taskswap/build_info.hpp>
#include <taskswap/error.hpp>

#include <gtest/gtest.h>

#include <dlfcn.h>

#include <cstdlib>
#include <string>

namespace taskswap::test {
namespace {

bool process_has_nccl() { return dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD) != nullptr; }

TEST(nccl_library, is_loaded_at_first_use_not_with_taskswap)
{
  if (std::getenv("TASKSWAP_NCCL_LIBRARY") != nullptr) { GTEST_SKIP() << "TASKSWAP_NCCL_LIBRARY is set"; }
  // The test binary links libtaskswap; linking it must not have brought NCCL in.
  ASSERT_FALSE(detail::nccl_loaded());
  ASSERT_FALSE(process_has_nccl()) << "libnccl.so.2 is in the process before taskswap asked for it";
  const detail::nccl_library& lib = detail::nccl();
  EXPECT_TRUE(detail::nccl_loaded());
  EXPECT_TRUE(process_has_nccl());
  EXPECT_GE(lib.version, detail::nccl_minimum_version);
  EXPECT_FALSE(lib.path.empty());
  int version = 0;
  ASSERT_EQ(lib.get_version(&version), ncclSuccess);
  EXPECT_EQ(version, lib.version);
  EXPECT_STREQ(lib.get_error_string(ncclInvalidArgument), "invalid argument (run with NCCL_DEBUG=WARN for details)");
  EXPECT_EQ(&detail::nccl(), &lib);  // once per process
  const build_info info = get_build_info();
  EXPECT_EQ(info.nccl_library, lib.path);
  EXPECT_EQ(info.nccl_version, lib.version_text());
}

// ctest runs this one with TASKSWAP_NCCL_LIBRARY pointing at a file that does not exist.
TEST(nccl_library, a_forced_library_that_does_not_load_is_named)
{
  const char* forced = std::getenv("TASKSWAP_NCCL_LIBRARY");
  if (forced == nullptr) { GTEST_SKIP() << "run with TASKSWAP_NCCL_LIBRARY set to a missing file"; }
  try {
    (void)detail::nccl();
    FAIL() << "a missing TASKSWAP_NCCL_LIBRARY loaded";
  } catch (const comm_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(forced), std::string::npos) << what;
    EXPECT_NE(what.find("TASKSWAP_NCCL_LIBRARY"), std::string::npos) << what;
  }
  EXPECT_FALSE(detail::nccl_loaded());
  EXPECT_FALSE(get_build_info().nccl_library.empty());  // why none could be, and no throw
  EXPECT_TRUE(get_build_info().nccl_version.empty());
}

}  // namespace
}  // namespace taskswap::test
