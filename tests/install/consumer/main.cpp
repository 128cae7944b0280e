// SPDX-License-Identifier: Apache-2.0
// A user's program against the installed taskswap: a round trip through an emulated device.

#include <taskswap/taskswap.hpp>

#include <cstdio>
#include <cstring>

int main()
{
  const taskswap::device dev = taskswap::emulated_device({.memory_bytes = 1 << 20});
  taskswap::stream s(dev);
  taskswap::pinned_buffer in(dev, 1000);
  taskswap::pinned_buffer out(dev, 1000);
  for (std::size_t i = 0; i < in.size(); ++i) { in.data()[i] = static_cast<std::byte>(i * 7 + 3); }
  taskswap::device_buffer d(dev, 1000);
  taskswap::copy_async(d.span(), in.span(), s);
  taskswap::copy_async(out.span(), d.span(), s);
  s.synchronize();
  if (std::memcmp(in.data(), out.data(), in.size()) != 0) {
    std::puts("consumer: round trip differs");
    return 1;
  }
  std::printf("consumer: taskswap %s, round trip through %s ok\n",
              taskswap::get_build_info().version.c_str(), dev.name().c_str());
  return 0;
}
