// SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// @brief Stopping at a step boundary on a signal (preemption: Slurm, Kubernetes and torchrun send
/// SIGTERM, Slurm's --signal SIGUSR1 ahead of time). A trainer installs stop_signals, passes
/// signal() to runtime::agree_stop at every step boundary, and when the ranks agree, saves a
/// checkpoint and exits (docs/reliability.md shows the loop).

#include <csignal>
#include <initializer_list>
#include <vector>

namespace taskswap {

/// @brief Handlers for the signals a trainer names. The first of them is remembered (signal());
/// a second one restores the signal's default action and raises it again, so the process ends at
/// once, as a user pressing Ctrl-C twice expects. The handlers only store an integer
/// (async-signal-safe); the previous actions are restored on destruction. One instance at a time.
class stop_signals {
 public:
  /// @brief Installs the handlers (default: SIGTERM, SIGINT, SIGUSR1).
  /// @throws invalid_argument if another stop_signals is alive or a number is not a signal
  explicit stop_signals(std::initializer_list<int> signals = {SIGTERM, SIGINT, SIGUSR1});
  ~stop_signals();
  stop_signals(const stop_signals&) = delete;
  stop_signals& operator=(const stop_signals&) = delete;
  stop_signals(stop_signals&&) = delete;
  stop_signals& operator=(stop_signals&&) = delete;

  /// @brief The first signal received since installation, 0 if none.
  [[nodiscard]] int signal() const noexcept;
  /// @brief The exit status a shell reports for a process ended by `sig`: 128 + sig.
  [[nodiscard]] static int exit_code(int sig) noexcept { return 128 + sig; }

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

}  // namespace taskswap
