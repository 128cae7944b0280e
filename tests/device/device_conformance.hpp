// SPDX-License-Identifier: Apache-2.0
#pragma once

// The device-layer conformance suite: the same behaviour on every backend. Instantiated once per
// backend (device_conformance_emulated.cpp, device_conformance_cuda.cpp); an instance whose
// backend is missing here skips every test with the reason.

#include "expect_error.hpp"
#include "test_seed.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace taskswap::test {

using namespace std::chrono_literals;
constexpr std::size_t MiB = std::size_t{1} << 20;

inline std::mt19937_64 fresh_generator(std::uint64_t& seed)
{
  seed = test_seed();
  return std::mt19937_64{seed};
}

inline void fill_random(std::span<std::byte> bytes, std::mt19937_64& gen)
{
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const std::uint64_t word = gen();
    std::memcpy(bytes.data() + i, &word, 8);
  }
  for (; i < bytes.size(); ++i) { bytes[i] = static_cast<std::byte>(gen()); }
}

template <typename Backend>
class device_conformance : public ::testing::Test {
 protected:
  void SetUp() override
  {
    if (const std::string reason = Backend::skip_reason(); !reason.empty()) { GTEST_SKIP() << reason; }
  }
  device make() { return Backend::make(); }
  // A device that is not make()'s.
  device other() { return emulated_device({.memory_bytes = 16 * MiB}); }
};

TYPED_TEST_SUITE_P(device_conformance);

TYPED_TEST_P(device_conformance, ExecutesInOrderWithinStream)
{
  const device dev = this->make();
  stream s(dev);
  std::vector<int> order;
  constexpr int n = 200;
  for (int i = 0; i < n; ++i) {
    launch_host_func(s, [&order, i] {
      if (i % 50 == 0) { std::this_thread::sleep_for(1ms); }  // a slow one must not be overtaken
      order.push_back(i);
    });
  }
  // Copies interleaved with host functions keep their order too: H2D, D2D, D2H of one value.
  std::uint64_t seed = 0;
  auto gen = fresh_generator(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  pinned_buffer in(dev, 4096);
  pinned_buffer out(dev, 4096);
  fill_random(in.span(), gen);
  std::memset(out.data(), 0x5A, out.size());
  device_buffer a(dev, 4096);
  device_buffer b(dev, 4096);
  copy_async(a.span(), in.span(), s);
  copy_async(b.span(), a.span(), s);
  copy_async(out.span(), b.span(), s);
  s.synchronize();
  ASSERT_EQ(order.size(), static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) { EXPECT_EQ(order[static_cast<std::size_t>(i)], i); }
  EXPECT_EQ(std::memcmp(in.data(), out.data(), in.size()), 0);
  EXPECT_TRUE(s.query());
}

TYPED_TEST_P(device_conformance, EventOrdersWorkAcrossStreams)
{
  const device dev = this->make();
  stream producer(dev);
  stream consumer(dev);
  event ready(dev);
  std::uint64_t seed = 0;
  auto gen = fresh_generator(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr std::size_t bytes = 8 * MiB + 3;
  pinned_buffer in(dev, bytes);
  pinned_buffer out(dev, bytes);
  fill_random(in.span(), gen);
  std::memset(out.data(), 0xA5, bytes);
  device_buffer d(dev, bytes);
  fill_async(d.span(), std::byte{0xEE}, producer);  // poison
  producer.synchronize();

  // The producer is held back; without the event the consumer would read the poison.
  launch_host_func(producer, [] { std::this_thread::sleep_for(50ms); });
  copy_async(d.span(), in.span(), producer);
  ready.record(producer);
  ready.wait(consumer);
  copy_async(out.span(), d.span(), consumer);
  consumer.synchronize();
  EXPECT_EQ(std::memcmp(in.data(), out.data(), bytes), 0);
  EXPECT_TRUE(ready.query());
}

TYPED_TEST_P(device_conformance, CopyRoundTripIsBitExactAtAwkwardSizes)
{
  const device dev = this->make();
  stream s(dev);
  std::uint64_t seed = 0;
  auto gen = fresh_generator(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::size_t> sizes{1, 3, 255, 4097, MiB + 13, 256 * MiB};
  const std::vector<std::size_t> offsets{0, 1, 7};
  for (const std::size_t size : sizes) {
    for (const std::size_t offset : offsets) {
      if (size == 256 * MiB && offset != 7) { continue; }  // the large size once, misaligned
      SCOPED_TRACE("size " + std::to_string(size) + " offset " + std::to_string(offset));
      const std::size_t padded = size + 16;
      pinned_buffer in(dev, padded);
      pinned_buffer out(dev, padded);
      device_buffer first(dev, padded);
      device_buffer second(dev, padded);
      fill_random(in.span(), gen);
      std::memset(out.data(), 0xCD, padded);
      fill_async(first.span(), std::byte{0x11}, s);
      fill_async(second.span(), std::byte{0x22}, s);
      copy_async(first.span(offset, size), in.span().subspan(offset, size), s);
      copy_async(second.span(offset + 3, size), first.span(offset, size), s);
      copy_async(out.span().subspan(offset + 5, size), second.span(offset + 3, size), s);
      s.synchronize();
      ASSERT_EQ(std::memcmp(in.data() + offset, out.data() + offset + 5, size), 0);
      // Bytes outside the copied range are untouched.
      for (std::size_t i = 0; i < offset + 5; ++i) { ASSERT_EQ(out.data()[i], std::byte{0xCD}); }
      for (std::size_t i = offset + 5 + size; i < padded; ++i) { ASSERT_EQ(out.data()[i], std::byte{0xCD}); }
    }
  }
}

TYPED_TEST_P(device_conformance, FillSetsEveryByte)
{
  const device dev = this->make();
  stream s(dev);
  constexpr std::size_t bytes = 3 * MiB + 1;
  device_buffer d(dev, bytes);
  pinned_buffer out(dev, bytes);
  fill_async(d.span(), std::byte{0x00}, s);
  fill_async(d.span(5, bytes - 10), std::byte{0x7F}, s);
  copy_async(out.span(), d.span(), s);
  s.synchronize();
  for (std::size_t i = 0; i < bytes; ++i) {
    const bool inside = i >= 5 && i < bytes - 5;
    ASSERT_EQ(out.data()[i], inside ? std::byte{0x7F} : std::byte{0x00}) << "at byte " << i;
  }
}

TYPED_TEST_P(device_conformance, RefusesAllocationBeyondMemoryWithTheNumbers)
{
  const device dev = this->make();
  const memory_info before = dev.memory();
  ASSERT_GT(before.total, 0U);
  const std::size_t too_much = before.total + 1;
  try {
    device_buffer b(dev, too_much);
    FAIL() << "allocating " << too_much << " bytes on a device of " << before.total << " succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_EQ(e.requested(), too_much);
    EXPECT_LE(e.available(), before.total);
    EXPECT_EQ(e.budget(), before.total);
    const std::string text = e.what();
    EXPECT_NE(text.find(std::to_string(too_much)), std::string::npos) << text;
    EXPECT_NE(text.find("free"), std::string::npos) << text;
  }
  // Memory is accounted: holding a buffer lowers the free figure by at least its size.
  {
    device_buffer held(dev, 64 * MiB);
    EXPECT_LE(dev.memory().free + 64 * MiB, before.free + MiB);  // slack: other processes
  }
  // Nothing leaked: the failed and the freed allocation are both back.
  EXPECT_GE(dev.memory().free + 2 * MiB, before.free);
}

TYPED_TEST_P(device_conformance, HostWaitsOnEvents)
{
  const device dev = this->make();
  stream s(dev);
  event done(dev);
  EXPECT_TRUE(done.query()) << "an event never recorded counts as complete";
  done.synchronize();  // and does not block

  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<bool> ran{false};
  launch_host_func(s, [released, &ran] {
    released.wait();
    ran = true;
  });
  done.record(s);
  EXPECT_FALSE(done.query());
  EXPECT_FALSE(done.synchronize_for(20ms));
  EXPECT_FALSE(s.query());
  release.set_value();
  EXPECT_TRUE(done.synchronize_for(30s));
  EXPECT_TRUE(ran);
  EXPECT_TRUE(done.synchronize_for(std::chrono::nanoseconds::max()));  // no deadline overflow
  EXPECT_TRUE(done.query());
  done.synchronize();
}

TYPED_TEST_P(device_conformance, WaitSeesTheRecordCurrentWhenIssued)
{
  const device dev = this->make();
  stream held(dev);
  stream waiter(dev);
  stream idle(dev);
  event e(dev);
  std::promise<void> release;
  auto released = release.get_future().share();
  launch_host_func(held, [released] { released.wait(); });
  e.record(held);
  e.wait(waiter);
  std::atomic<bool> passed{false};
  launch_host_func(waiter, [&passed] { passed = true; });
  e.record(idle);  // a later record, complete at once, must not release the earlier wait
  idle.synchronize();
  EXPECT_TRUE(e.query());
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(passed);
  release.set_value();
  waiter.synchronize();
  EXPECT_TRUE(passed);
}

TYPED_TEST_P(device_conformance, DestroyingAStreamWithQueuedWorkCompletesTheWork)
{
  const device dev = this->make();
  std::atomic<int> finished{0};
  event after(dev);
  stream other(dev);
  {
    stream s(dev);
    for (int i = 0; i < 10; ++i) {
      launch_host_func(s, [&finished] {
        std::this_thread::sleep_for(2ms);
        ++finished;
      });
    }
    after.record(s);
  }  // destroyed with work queued
  after.wait(other);
  other.synchronize();
  EXPECT_EQ(finished.load(), 10);
}

TYPED_TEST_P(device_conformance, DestroyingABufferWaitsForQueuedWork)
{
  const device dev = this->make();
  stream s(dev);
  std::uint64_t seed = 0;
  auto gen = fresh_generator(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr std::size_t bytes = 32 * MiB;
  pinned_buffer in(dev, bytes);
  pinned_buffer out(dev, bytes);
  fill_random(in.span(), gen);
  std::atomic<bool> copied{false};
  {
    device_buffer d(dev, bytes);
    launch_host_func(s, [] { std::this_thread::sleep_for(30ms); });
    copy_async(d.span(), in.span(), s);
    copy_async(out.span(), d.span(), s);
    launch_host_func(s, [&copied] { copied = true; });
  }  // freeing waits for the copies, as cudaFree does
  EXPECT_TRUE(copied);
  EXPECT_EQ(std::memcmp(in.data(), out.data(), bytes), 0);
}

TYPED_TEST_P(device_conformance, HostFunctionErrorsReachSynchronize)
{
  const device dev = this->make();
  stream s(dev);
  std::atomic<bool> later_ran{false};
  launch_host_func(s, [] { throw std::runtime_error("boom in a host function"); });
  launch_host_func(s, [&later_ran] { later_ran = true; });
  try {
    s.synchronize();
    FAIL() << "synchronize did not rethrow the host function's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom in a host function");
  }
  EXPECT_TRUE(later_ran);
  s.synchronize();  // reported once
}

TYPED_TEST_P(device_conformance, HostFunctionErrorsStayWithTheirStream)
{
  const device dev = this->make();
  event done(dev);
  {
    stream doomed(dev);
    launch_host_func(doomed, [] {
      std::this_thread::sleep_for(5ms);
      throw std::runtime_error("error of a destroyed stream");
    });
    done.record(doomed);
  }  // destroyed with the throwing function still queued
  done.synchronize();
  // Streams made now may reuse the destroyed stream's handle; none inherits its error.
  for (int i = 0; i < 8; ++i) {
    stream fresh(dev);
    launch_host_func(fresh, [] {});
    EXPECT_NO_THROW(fresh.synchronize());
  }
}

TYPED_TEST_P(device_conformance, RejectsBadArgumentsWithClearErrors)
{
  const device dev = this->make();
  const device elsewhere = this->other();
  ASSERT_FALSE(dev == elsewhere);
  stream s(dev);
  stream foreign(elsewhere);
  device_buffer d(dev, 1024);
  pinned_buffer h(dev, 1024);

  auto expect_message = [](auto&& call, const std::string& needle) {
    expect_error_mentioning<invalid_argument>(call, needle);
  };
  // A null host pointer with a size.
  expect_message(
    [&] { copy_async(d.span(0, 16), std::span<const std::byte>(static_cast<const std::byte*>(nullptr), 16), s); },
    "null source");
  // Sizes that differ.
  expect_message([&] { copy_async(d.span(0, 16), h.span().subspan(0, 8), s); }, "has 16 bytes but source has 8");
  // A range beyond the buffer.
  expect_message([&] { static_cast<void>(d.span(1000, 100)); },
                 "range [1000, 1100) reaches beyond a device span of 1024 bytes");
  expect_message([&] { static_cast<void>(d.span(2000, 0)); }, "reaches beyond");
  // A stream of another device.
  expect_message([&] { copy_async(d.span(), h.span(), foreign); }, "but the stream belongs to device");
  expect_message([&] { copy_async(h.span(), d.span(), foreign); }, "the source belongs to device");
  expect_message([&] { fill_async(d.span(), std::byte{0}, foreign); }, "the destination belongs");
  event e(dev);
  expect_message([&] { e.record(foreign); }, "the event belongs");
  expect_message([&] { e.wait(foreign); }, "the event belongs");
  // Priorities outside the range; empty host functions; timing on events without it.
  expect_message([&] { stream bad(dev, {.priority = 1000}); }, "outside device");
  expect_message([&] { launch_host_func(s, {}); }, "empty function");
  event plain(dev);
  expect_message([&] { static_cast<void>(elapsed_ms(plain, e)); }, "timing = true");
  event never_a(dev, {.timing = true});
  event never_b(dev, {.timing = true});
  expect_message([&] { static_cast<void>(elapsed_ms(never_a, never_b)); }, "two recorded events");
  // Nothing was enqueued by the refused calls.
  s.synchronize();
  EXPECT_TRUE(s.query());
}

TYPED_TEST_P(device_conformance, TimingEventsMeasureElapsedTime)
{
  const device dev = this->make();
  stream s(dev);
  event start(dev, {.timing = true});
  event end(dev, {.timing = true});
  start.record(s);
  launch_host_func(s, [] { std::this_thread::sleep_for(25ms); });
  end.record(s);
  end.synchronize();
  const double ms = elapsed_ms(start, end);
  EXPECT_GE(ms, 20.0);  // a lower bound only: the host function held the stream this long
  EXPECT_LT(ms, 60'000.0);
}

TYPED_TEST_P(device_conformance, StreamPrioritiesAndOwnershipMoves)
{
  const device dev = this->make();
  const auto [least, greatest] = dev.stream_priority_range();
  stream low(dev, {.priority = least});
  stream high(dev, {.priority = greatest});
  EXPECT_EQ(low.priority(), least);
  EXPECT_EQ(high.priority(), greatest);
  EXPECT_FALSE(low.view() == high.view());

  stream moved(std::move(low));
  EXPECT_EQ(moved.priority(), least);
  std::atomic<bool> ran{false};
  launch_host_func(moved, [&ran] { ran = true; });
  moved = stream(dev);  // the old stream is destroyed; its work still completes
  dev.synchronize();
  EXPECT_TRUE(ran);

  device_buffer a(dev, 4096);
  const std::byte* where = a.data();
  device_buffer b(std::move(a));
  EXPECT_EQ(b.data(), where);
  EXPECT_EQ(b.size(), 4096U);
  EXPECT_EQ(a.size(), 0U);  // NOLINT(bugprone-use-after-move): moved-from state is specified: empty
  EXPECT_EQ(a.data(), nullptr);
  device_buffer empty(dev, 0);
  EXPECT_TRUE(empty.span().empty());
}

TYPED_TEST_P(device_conformance, ExternalStreamsAreCudaStreamsAndTheEmulatedDeviceRefusesThem)
{
  const device dev = this->make();
  const stream own(dev);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a framework's handle
  const auto handle = reinterpret_cast<std::uintptr_t>(own.view().native_handle());
  if (dev.kind() == backend_kind::emulated) {
    try {
      (void)external_stream(dev, handle);
      FAIL() << "the emulated device wrapped an external stream";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("use a taskswap::stream"), std::string::npos) << e.what();
    }
    return;
  }
  // A stream made elsewhere (here: our own, by its integer handle) is the same stream.
  EXPECT_TRUE(external_stream(dev, handle) == own.view());
  // 0, PyTorch's default stream: the legacy default stream, usable for copies, events, host waits.
  const stream_view legacy = external_stream(dev, 0);
  EXPECT_NE(legacy.native_handle(), nullptr);
  std::uint64_t seed = 0;
  auto gen = fresh_generator(seed);
  pinned_buffer src(dev, 4096);
  pinned_buffer dst(dev, 4096);
  device_buffer mid(dev, 4096);
  fill_random(src.span(), gen);
  copy_async(mid.span(), src.span(), legacy);
  event copied(dev);
  copied.record(legacy);
  copied.wait(own);
  copy_async(dst.span(), mid.span(), own);
  own.synchronize();
  legacy.synchronize();
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), 4096));
}

REGISTER_TYPED_TEST_SUITE_P(device_conformance, ExecutesInOrderWithinStream, EventOrdersWorkAcrossStreams,
                            CopyRoundTripIsBitExactAtAwkwardSizes, FillSetsEveryByte,
                            RefusesAllocationBeyondMemoryWithTheNumbers, HostWaitsOnEvents,
                            WaitSeesTheRecordCurrentWhenIssued, DestroyingAStreamWithQueuedWorkCompletesTheWork,
                            DestroyingABufferWaitsForQueuedWork, HostFunctionErrorsReachSynchronize,
                            HostFunctionErrorsStayWithTheirStream, RejectsBadArgumentsWithClearErrors,
                            TimingEventsMeasureElapsedTime, StreamPrioritiesAndOwnershipMoves,
                            ExternalStreamsAreCudaStreamsAndTheEmulatedDeviceRefusesThem);

}  // namespace taskswap::test
