// SPDX-License-Identifier: Apache-2.0
#pragma once

// Asserts that a call throws `Error` (taskswap::error unless named) whose message contains a
// given text: errors must say what to change, so tests check the words, not only the type.

#include <taskswap/error.hpp>

#include <gtest/gtest.h>

#include <string>

namespace taskswap::test {

template <typename Error = error, typename Call>
void expect_error_mentioning(Call&& call, const std::string& needle)
{
  try {
    call();
    ADD_FAILURE() << "no exception; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace taskswap::test
