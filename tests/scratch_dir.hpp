// SPDX-License-Identifier: Apache-2.0
#pragma once

// A fixture whose tests each get a directory of their own under the system's temporary directory,
// named by suite, process and test, empty at the start and removed at the end.

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

namespace taskswap::test {

class scratch_dir_test : public ::testing::Test {
 protected:
  void SetUp() override
  {
    const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("taskswap-" + std::string(t->test_suite_name()) + "-" + std::to_string(::getpid()) + "-" + t->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

}  // namespace taskswap::test
