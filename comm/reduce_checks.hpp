// SPDX-License-Identifier: Apache-2.0
#pragma once

// The checks every communicator makes of the slabs it is asked to reduce.

#include "device/expects.hpp"
#include "device/message.hpp"

#include <taskswap/comm.hpp>

#include <string_view>

namespace taskswap::detail {

/// Each slab is on `dev` and a whole number of elements; `backend` and `hint` name the
/// communicator and the one to use instead.
inline void check_reduce_item(const reduce_item& it, const device& dev, std::string_view backend, std::string_view what,
                              std::string_view hint)
{
  TASKSWAP_EXPECTS(it.data.owner() == &dev.backend(),
                   message(backend, " allreduce of ", what, ": the buffer is not on the communicator's device (",
                           dev.name(), "); ", hint));
  TASKSWAP_EXPECTS(is_floating(it.type), message(backend, " allreduce of ", what,
                                                 ": u8 is raw bytes (a frozen unit's); reduce f32, bf16 or f16"));
  TASKSWAP_EXPECTS(it.data.size() % size_of(it.type) == 0,
                   message(backend, " allreduce of ", what, ": ", it.data.size(), " bytes is not a whole number of ",
                           to_string(it.type), " elements"));
}

inline void check_broadcast(device_span data, int root, int size, const device& dev, std::string_view backend,
                            std::string_view what, std::string_view hint)
{
  TASKSWAP_EXPECTS(data.size() == 0 || data.owner() == &dev.backend(),
                   message(backend, " broadcast of ", what, ": the buffer is not on the communicator's device (",
                           dev.name(), "); ", hint));
  TASKSWAP_EXPECTS(root >= 0 && root < size,
                   message(backend, " broadcast of ", what, ": root ", root, " is not a rank of ", size));
}

}  // namespace taskswap::detail
