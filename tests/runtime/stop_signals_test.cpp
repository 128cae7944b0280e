// SPDX-License-Identifier: Apache-2.0
#include "expect_error.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <csignal>

namespace taskswap::test {
namespace {

TEST(stop_signals, the_first_signal_is_remembered_and_the_previous_action_comes_back)
{
  {
    const stop_signals signals({SIGUSR1, SIGTERM});
    EXPECT_EQ(signals.signal(), 0);
    ASSERT_EQ(std::raise(SIGUSR1), 0);  // handled synchronously: the process goes on
    EXPECT_EQ(signals.signal(), SIGUSR1);
    EXPECT_EQ(stop_signals::exit_code(SIGTERM), 143);
    expect_error_mentioning<invalid_argument>([] { const stop_signals again; }, "another instance is installed");
  }
  struct sigaction now {};
  ASSERT_EQ(sigaction(SIGUSR1, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_DFL);  // restored
  const stop_signals fresh({SIGUSR1});  // a new instance starts with nothing received
  EXPECT_EQ(fresh.signal(), 0);
}

TEST(stop_signals, a_second_signal_ends_the_process_at_once)
{
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
    {
      const stop_signals signals({SIGINT});
      std::raise(SIGINT);
      if (signals.signal() != SIGINT) { std::_Exit(3); }
      std::raise(SIGINT);  // the default action: the process ends here
      std::_Exit(4);
    },
    ::testing::KilledBySignal(SIGINT), "");
}

TEST(stop_signals, without_a_communicator_agreeing_returns_this_ranks_code_at_once)
{
  const device dev = emulated_device({.memory_bytes = 1 << 20, .link = {}});
  runtime_options o;
  o.device.backend = backend_kind::emulated;
  o.device.budget = 1 << 20;
  runtime rt(dev, o, {unit_spec{.name = "u", .tensors = {{"w", {64}}}}});
  EXPECT_EQ(rt.agree_stop(0), 0);
  EXPECT_EQ(rt.agree_stop(SIGTERM), SIGTERM);
}

}  // namespace
}  // namespace taskswap::test
