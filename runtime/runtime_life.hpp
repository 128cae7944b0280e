// SPDX-License-Identifier: Apache-2.0
#pragma once

// The runtime's life (runtime::impl::life_), one named state read and changed by its parts.
// Construction registers the units and places their homes; the first plan, acquire or flush
// starts it (the pinned units go to the device, the parameters are derived from their masters);
// with a communicator the first plan also makes the replicas equal. A failure of the device, a
// wait, a collective or a unit file ends it: every later call throws that first error again and
// nothing more is written home. A checkpoint load that failed part way is the one failure a
// later call undoes (a load that succeeds).

#include <taskswap/error.hpp>

#include <exception>

namespace taskswap::detail {

struct runtime_life {
  bool started = false;  // start() ran: the pinned units are on the device
  bool derived = false;  // derive_params() ran: the host homes' parameters follow their masters
  bool replicas_synced = false;  // with a communicator: the replicas were made equal
  bool warned_host_cache = false;  // check_host_cache() warned, once per runtime
  std::exception_ptr failed;  // the first failure; every later call throws it again
  bool load_failed = false;  // `failed` is a load that overwrote part of the home copies

  // Runs `body`. After the device failed, a wait timed out, a collective failed or a unit file
  // could not be read or written, every later call throws that first error again, and the
  // runtime writes nothing home any more: a unit on the device may hold work that never
  // finished, or an update from gradients that never arrived; a disk home may be half read.
  template <typename Body>
  decltype(auto) guarded(Body&& body)
  {
    if (failed) { std::rethrow_exception(failed); }
    try {
      return body();
    } catch (const device_error&) {
      failed = std::current_exception();
      throw;
    } catch (const timeout_error&) {
      failed = std::current_exception();
      throw;
    } catch (const comm_error&) {
      failed = std::current_exception();
      throw;
    } catch (const cuda_error&) {  // a sticky CUDA error surfaces as the first call's failure
      failed = std::current_exception();
      throw;
    } catch (const storage_error&) {
      failed = std::current_exception();
      throw;
    }
  }
};

}  // namespace taskswap::detail
