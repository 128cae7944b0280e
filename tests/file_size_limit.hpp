// SPDX-License-Identifier: Apache-2.0
#pragma once

// A file size limit for a test's scope: a write past `bytes` then fails with EFBIG (SIGXFSZ is
// ignored meanwhile), as a full or failing drive's would; the old limit and handler come back at
// the scope's end.

#include <sys/resource.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cstddef>

namespace taskswap::test {

class file_size_limit {
 public:
  explicit file_size_limit(std::size_t bytes)
  {
    EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &old_), 0);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = old_;
    small.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  }
  ~file_size_limit()
  {
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &old_), 0);
    std::signal(SIGXFSZ, old_handler_);
  }
  file_size_limit(const file_size_limit&) = delete;
  file_size_limit& operator=(const file_size_limit&) = delete;

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

}  // namespace taskswap::test
