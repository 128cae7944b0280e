// SPDX-License-Identifier: Apache-2.0
// stop_signals: async-signal-safe handlers that remember the first stop signal; a second one ends the process.

#include <taskswap/error.hpp>
#include <taskswap/stop.hpp>

#include "device/message.hpp"

#include <atomic>
#include <cerrno>
#include <cstring>

namespace taskswap {
namespace {

std::atomic<int> received{0};
std::atomic<bool> installed{false};
static_assert(std::atomic<int>::is_always_lock_free, "the handler stores into a lock-free atomic");

extern "C" void on_stop_signal(int sig)
{
  int none = 0;
  if (received.compare_exchange_strong(none, sig)) { return; }
  // A second signal: the default action, now. signal() and raise() are async-signal-safe; the
  // raised signal is blocked until this handler returns, then ends the process.
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

stop_signals::stop_signals(std::initializer_list<int> signals) : signals_(signals)
{
  bool expected = false;
  if (!installed.compare_exchange_strong(expected, true)) {
    throw invalid_argument("stop_signals: another instance is installed; keep one for the process");
  }
  received.store(0);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a blocking call the signal interrupts goes on
  for (const int sig : signals_) {
    struct sigaction old {};
    if (sigaction(sig, &action, &old) != 0) {
      const int err = errno;
      for (std::size_t i = previous_.size(); i-- > 0;) { sigaction(signals_[i], &previous_[i], nullptr); }
      installed.store(false);
      throw invalid_argument(detail::message("stop_signals: cannot handle signal ", sig, ": ", std::strerror(err)));
    }
    previous_.push_back(old);
  }
}

stop_signals::~stop_signals()
{
  // In reverse: a signal named twice gets back the action it had before the first installation.
  for (std::size_t i = previous_.size(); i-- > 0;) { sigaction(signals_[i], &previous_[i], nullptr); }
  installed.store(false);
}

int stop_signals::signal() const noexcept { return received.load(); }

}  // namespace taskswap
