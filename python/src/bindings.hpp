// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the extension's two translation units share: the stream object Python holds, and the
// binding functions each defines.

#include <taskswap/taskswap.hpp>

#include <nanobind/nanobind.h>

#include <optional>

namespace taskswap::python {

/// A stream as Python holds it: one the runtime created (owned), or a view of another library's
/// (torch's current stream), which the owner keeps alive.
struct py_stream {
  taskswap::device dev;
  std::optional<taskswap::stream> owned;
  taskswap::stream_view view;
};

void bind_runtime(nanobind::module_& m);

}  // namespace taskswap::python
