// SPDX-License-Identifier: Apache-2.0
// A home tier is one file and one row (Note [Home tiers]): this file defines a tier the library
// does not have, "counting" (the host tier's memory, a stage-in that waits a little on its stream,
// every call counted), adds it with add_home_tier(), and trains units homed there. Every home
// copy goes through the tier, and the result is the one of the same loop with host homes.

#include "runtime/homes/home_tier.hpp"
#include "runtime/training_loop.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace taskswap::detail {

extern const home_tier host_home_tier;  // the library's own (home_tier_host.cpp)

namespace {

struct counts {
  std::atomic<int> opened{0};
  std::atomic<int> placed{0};
  std::atomic<int> staged{0};
  std::atomic<int> written{0};
  std::atomic<int> blocks{0};
};

counts& counted()
{
  static counts c;
  return c;
}

std::size_t counting_store_bytes(const storage_options& /*storage*/) { return 0; }

void counting_open_store(home_store& /*store*/, const device& /*dev*/, const storage_options& /*storage*/)
{
  ++counted().opened;
}

std::size_t counting_pinned_bytes(std::size_t bytes) { return host_home_tier.pinned_bytes(bytes); }

void counting_place(home_store& store, unit_home& home, const home_request& request)
{
  ++counted().placed;
  host_home_tier.place(store, home, request);
}

void counting_stage_in(const unit_home& home, std::size_t offset, device_span dst, stream_view s)
{
  ++counted().staged;
  launch_host_func(s, [] { std::this_thread::sleep_for(std::chrono::microseconds(200)); });  // a slow medium
  host_home_tier.stage_in(home, offset, dst, s);
}

void counting_write_back(const unit_home& home, std::size_t offset, const_device_span src, stream_view s)
{
  ++counted().written;
  host_home_tier.write_back(home, offset, src, s);
}

std::span<std::byte> counting_block(const unit_home& home)
{
  ++counted().blocks;
  return host_home_tier.host_block(home);
}

bool counting_ready(const unit_home& home) { return host_home_tier.ready(home); }

void counting_used(const unit_home& home, const stream_view* s, bool wrote) { host_home_tier.used(home, s, wrote); }

const home_tier counting_tier{.name = "counting",
                              .cached = false,
                              .store_bytes = counting_store_bytes,
                              .open_store = counting_open_store,
                              .pinned_bytes = counting_pinned_bytes,
                              .place = counting_place,
                              .stage_in = counting_stage_in,
                              .write_back = counting_write_back,
                              .host_block = counting_block,
                              .ready = counting_ready,
                              .used = counting_used};

// Six task units (device AdamW, then host AdamW, in turn) in a budget of two, prefetched, homed
// in `home`; trained 30 steps; every home's bytes after.
std::string train(const std::string& home)
{
  std::vector<unit_spec> units;
  for (int t = 0; t < 6; ++t) {
    units.push_back({.name = "task/" + std::to_string(t), .tensors = {{"w", {20'000}}}, .compute = dtype::f32});
  }
  runtime_options o;
  o.device = {.backend = backend_kind::emulated, .budget = 700 * 1024};
  o.optimizer.lr = 1e-2;
  unit_rule all;
  all.match = "task/*";
  all.residency = residency::prefetch;
  all.lookahead = 1;
  all.home = home;
  o.units.push_back(all);
  unit_rule host_adamw;
  host_adamw.match = "task/[135]";
  host_adamw.optimizer = optimizer_placement::host;
  o.units.push_back(host_adamw);
  const device dev = emulated_device({.memory_bytes = std::size_t{4} << 20U, .link = {}});
  const stream s(dev);
  runtime rt(dev, o, units);
  for (std::size_t u = 0; u < units.size(); ++u) {
    const home_view h = rt.home({static_cast<std::uint32_t>(u)});
    auto* m = static_cast<float*>(h.master.data);
    for (std::size_t k = 0; k < h.master.count; ++k) { m[k] = 0.001F * static_cast<float>((k * 7 + u) % 97); }
  }
  const auto task = [&](std::uint64_t step) { return rt.find("task/" + std::to_string((step * 5 + step / 4) % 6)); };
  std::vector<step_plan> plans;
  for (std::uint64_t step = 0; step < 30; ++step) { plans.push_back(step_plan{task(step)}); }
  rt.plan(plans);
  for (std::uint64_t step = 0; step < 30; ++step) { test::train_step(rt, s, {task(step)}, step); }
  return test::home_state(rt);
}

TEST(home_tier, a_tier_defined_outside_the_library_is_one_file_and_one_row)
{
  add_home_tier(counting_tier);
  EXPECT_NE(home_tier_names().find("\"counting\""), std::string::npos);
  const std::string host = train("host");
  EXPECT_EQ(counted().placed.load(), 0);  // the host run never touched it
  const std::string counting = train("counting");
  EXPECT_EQ(counting, host);
  EXPECT_EQ(counted().opened.load(), 1);  // its shared parts, once
  EXPECT_EQ(counted().placed.load(), 6);
  EXPECT_GT(counted().staged.load(), 20);  // every swap-in (and the host AdamW's uploads)
  EXPECT_GT(counted().written.load(), 10);  // write-backs and gradients home
  EXPECT_GT(counted().blocks.load(), 6);  // home(), the CPU AdamW, the flush
  EXPECT_FALSE(home_is_cached(unit_policy{.home = "counting"}));
  EXPECT_TRUE(home_is_cached(unit_policy{.home = "disk"}));
  EXPECT_THROW(add_home_tier(counting_tier), invalid_argument);
}

}  // namespace
}  // namespace taskswap::detail
