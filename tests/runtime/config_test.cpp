// SPDX-License-Identifier: Apache-2.0
// The TOML configuration: the example of DESIGN.md, and errors that name file, line and key.

#include "expect_error.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

namespace taskswap::test {
namespace {

// Parsing `text` as my.toml fails with a config_error that says `needle`.
void fails(const std::string& text, const std::string& needle)
{
  expect_error_mentioning<config_error>([&] { (void)parse_config(text, "my.toml"); }, needle);
}

constexpr const char* design_example = R"(
[device]
backend = "cuda"        # cuda | emulated
index   = 0
budget  = "40 GiB"

[defaults]
residency = "prefetch"  # pinned | prefetch | on_demand
lookahead = 2
optimizer = "device"    # device | host

[[units]]
match = "trunk/*"
residency = "pinned"

[[units]]
match = "task/*"
optimizer = "host"

[optimizer]
kind = "adamw"
lr = 1e-4
betas = [0.9, 0.999]
eps = 1e-8
weight_decay = 0.01

[comm]
backend    = "nccl"     # nccl | mpi | none
bucket_cap = "25 MiB"
average    = "contributors"   # contributors | world
timeout    = "300 s"
)";

TEST(config, the_design_example_reads_into_the_options)
{
  const runtime_options o = parse_config(design_example, "design.toml");
  EXPECT_EQ(o.device.backend, backend_kind::cuda);
  EXPECT_EQ(o.device.budget, std::size_t{40} << 30);
  EXPECT_EQ(o.defaults.residency, residency::prefetch);
  EXPECT_EQ(o.defaults.lookahead, 2);
  ASSERT_EQ(o.units.size(), 2U);
  EXPECT_EQ(o.units[0].match, "trunk/*");
  EXPECT_EQ(o.units[0].residency, residency::pinned);
  EXPECT_FALSE(o.units[0].optimizer.has_value());
  EXPECT_EQ(o.units[1].optimizer, optimizer_placement::host);
  EXPECT_EQ(o.units[1].origin, "design.toml:16");
  EXPECT_DOUBLE_EQ(o.optimizer.lr, 1e-4);
  EXPECT_DOUBLE_EQ(o.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(o.optimizer.weight_decay, 0.01);
  EXPECT_EQ(o.comm.backend, comm_backend::nccl);
  EXPECT_EQ(o.comm.bucket_cap, std::size_t{25} << 20);
  EXPECT_EQ(o.comm.average, average_mode::contributors);
  EXPECT_EQ(o.comm.timeout, std::chrono::seconds(300));
  EXPECT_FALSE(o.comm.reduce_every_unit);
}

TEST(config, an_emulated_device_with_a_link_model)
{
  const runtime_options o = parse_config(R"(
[device]
backend = "emulated"
budget = "512 MiB"
link_bandwidth = "5 GB/s"
link_latency = "10 us"
[runtime]
trace = true
)");
  EXPECT_EQ(o.device.backend, backend_kind::emulated);
  EXPECT_DOUBLE_EQ(o.device.emulated.link.bytes_per_second, 5e9);
  EXPECT_DOUBLE_EQ(o.device.emulated.link.latency_seconds, 10e-6);
  EXPECT_TRUE(o.trace);
  const device dev = make_device(o.device);
  EXPECT_EQ(dev.kind(), backend_kind::emulated);
  EXPECT_EQ(dev.memory().total, std::size_t{512} << 20);  // the budget, when no memory is given
}

// A named profile sets the device's figures, the keys after it override them, and time_scale
// slows the whole device. The h200 profile's figures are the ones docs/gpu-results.md measured.
TEST(config, an_emulated_profile_and_its_overrides)
{
  const runtime_options o = parse_config(R"(
[device]
backend = "emulated"
budget = "64 MiB"
link_bandwidth = "40 GB/s"
profile = "h200"
time_scale = 26
[device.vm_costs]
access = "50 us"
unmap_per_mib = "0.5 us"
busy_factor = 3.0
)");
  const emulated_options& e = o.device.emulated;
  EXPECT_EQ(e.granularity, std::size_t{2} << 20);
  EXPECT_DOUBLE_EQ(e.link.bytes_per_second, 40e9);  // the key wins over the profile, wherever it stands
  EXPECT_DOUBLE_EQ(e.link.latency_seconds, 8e-6);
  EXPECT_DOUBLE_EQ(e.time_scale, 26.0);
  EXPECT_DOUBLE_EQ(e.vm_costs.access.per_call_seconds, 50e-6);
  EXPECT_DOUBLE_EQ(e.vm_costs.map.per_call_seconds, 0.7e-6);  // the profile's
  EXPECT_DOUBLE_EQ(e.vm_costs.unmap.per_call_seconds, 20e-6);
  EXPECT_DOUBLE_EQ(e.vm_costs.unmap.per_mib_seconds, 0.5e-6);
  EXPECT_DOUBLE_EQ(e.vm_costs.busy_factor, 3.0);
  EXPECT_TRUE(e.vm_costs.enabled());
  EXPECT_FALSE(vm_cost_model{}.enabled());
  const std::string head = "[device]\nbackend = \"emulated\"\nbudget = \"1 GiB\"\n";
  fails(head + "profile = \"h100\"\n", "my.toml:4: [device] profile: unknown value \"h100\"; use h200");
  fails(head + "time_scale = 0\n", "my.toml:4: [device] time_scale: 0 must be more than 0");
  fails(head + "vm_costs = 3\n", "my.toml:4: [device] vm_costs: must be a table");
  fails(head + "[device.vm_costs]\nmap = \"1\"\n",
        "my.toml:5: [device.vm_costs] map: \"1\" is not a quantity with a unit");
  fails(head + "[device.vm_costs]\nbusy_factor = 0.5\n", "my.toml:5: [device.vm_costs] busy_factor: 0.5 is below 1");
  fails(head + "[device.vm_costs]\nmapp = \"1 us\"\n", "my.toml:5: [device.vm_costs] has no key 'mapp'");
}

TEST(config, sizes_need_a_unit)
{
  EXPECT_EQ(parse_size("1.5 KiB"), 1536U);
  EXPECT_EQ(parse_size("2GB"), 2'000'000'000U);
  expect_error_mentioning<config_error>([] { (void)parse_size("4096"); }, "not a size with a unit");
  expect_error_mentioning<config_error>([] { (void)parse_size("4 parsecs"); }, "not a size with a unit");
}

TEST(config, comm_initial_and_reduce_every_unit_and_the_old_reduce_all_explained)
{
  const runtime_options o =
    parse_config("[device]\nbudget = \"1 GiB\"\n[comm]\ninitial = \"verify\"\nreduce = \"every_unit\"\n", "c.toml");
  EXPECT_EQ(o.comm.initial, initial_sync::verify);
  EXPECT_TRUE(o.comm.reduce_every_unit);
  EXPECT_EQ(parse_config("[device]\nbudget = \"1 GiB\"\n", "c.toml").comm.initial, initial_sync::broadcast);
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 GiB\"\n[comm]\nreduce = \"all\"\n", "c.toml"); },
    "c.toml:4: [comm] reduce: \"all\" is now \"every_unit\"");
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 GiB\"\n[comm]\ninitial = \"copy\"\n", "c.toml"); },
    "unknown value \"copy\"; use broadcast | verify");
}

// Found by fuzz/config_fuzzer: a size beyond 64 bits was converted with undefined behaviour.
TEST(config, quantities_too_large_for_64_bits_are_refused)
{
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"5222222222222222212 MiB\"\n", "big.toml"); },
    "big.toml:2: [device] budget: \"5222222222222222212 MiB\" is too large");
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 GiB\"\n[comm]\ntimeout = \"1e300 min\"\n", "big.toml"); },
    "is too large");
}

TEST(config, param_groups_per_rule_and_their_errors)
{
  const runtime_options o = parse_config("[device]\nbudget = \"1 GiB\"\n[defaults]\nlr_scale = 0.5\n"
                                         "[[units]]\nmatch = \"task/*\"\nlr_scale = 10.0\nweight_decay = 0.0\n",
                                         "my.toml");
  EXPECT_EQ(o.defaults.lr_scale, 0.5);
  EXPECT_FALSE(o.defaults.weight_decay.has_value());
  ASSERT_EQ(o.units.size(), 1U);
  EXPECT_EQ(o.units[0].lr_scale, 10.0);
  EXPECT_EQ(o.units[0].weight_decay, 0.0);
  unit_spec task{.name = "task/3", .tensors = {{"w", {4}}}};
  const unit_policy p = policy_for(task, o);
  EXPECT_EQ(p.lr_scale, 10.0);  // the rule wins over the defaults
  EXPECT_EQ(p.weight_decay, 0.0);
  fails("[device]\nbudget = \"1 GiB\"\n[[units]]\nmatch = \"a\"\nlr_scale = 0.0\n",
        "my.toml:5: [[units]] lr_scale: must be more than 0");
  fails("[device]\nbudget = \"1 GiB\"\n[[units]]\nmatch = \"a\"\nweight_decay = -0.1\n",
        "my.toml:5: [[units]] weight_decay: must be 0 or more");
}

TEST(config, a_units_home_tier_is_named_by_a_rule_and_checked)
{
  const runtime_options o = parse_config("[device]\nbudget = \"1 GiB\"\n[defaults]\nhome = \"host\"\n"
                                         "[[units]]\nmatch = \"task/*\"\nhome = \"host\"\n",
                                         "my.toml");
  EXPECT_EQ(o.defaults.home, "host");
  EXPECT_EQ(o.units[0].home, std::optional<std::string>("host"));
  EXPECT_EQ(policy_for(unit_spec{.name = "task/1", .tensors = {{"w", {4}}}}, o).home, "host");
  expect_error_mentioning<config_error>(
    [] { (void)parse_config("[device]\nbudget = \"1 GiB\"\n[[units]]\nmatch = \"a\"\nhome = \"tape\"\n", "my.toml"); },
    "my.toml:5: [[units]] home: \"tape\" is not a home tier; the tiers are \"host\", \"disk\"");
  runtime_options code;
  code.device.budget = 1 << 20;
  code.defaults.home = "tape";
  expect_error_mentioning<config_error>(
    [&] {
      runtime rt(emulated_device({.memory_bytes = 1 << 20}), code, {unit_spec{.name = "u", .tensors = {{"w", {4}}}}});
    },
    "unit 'u': home \"tape\" is not a home tier");
}

TEST(config, storage_names_the_disk_tiers_directory_cache_and_requests)
{
  const runtime_options o =
    parse_config("[device]\nbudget = \"1 GiB\"\n[storage]\npath = \"/nvme/ts\"\nhost_cache = \"3 GiB\"\n"
                 "queue_depth = 16\nblock = \"256 KiB\"\ntimeout = \"90 s\"\n[[units]]\nmatch = \"task/*\"\nhome = "
                 "\"disk\"\n",
                 "my.toml");
  EXPECT_EQ(o.storage.path, std::filesystem::path("/nvme/ts"));
  EXPECT_EQ(o.storage.host_cache, std::size_t{3} << 30U);
  EXPECT_EQ(o.storage.queue_depth, 16U);
  EXPECT_EQ(o.storage.block, std::size_t{256} << 10U);
  EXPECT_EQ(o.storage.timeout, std::chrono::seconds(90));
  EXPECT_EQ(o.units[0].home, std::optional<std::string>("disk"));
  const runtime_options defaults = parse_config("[device]\nbudget = \"1 GiB\"\n", "my.toml");
  EXPECT_EQ(defaults.storage.queue_depth, 8U);
  EXPECT_EQ(defaults.storage.block, std::size_t{1} << 20U);
  EXPECT_EQ(defaults.storage.timeout, std::chrono::seconds(300));
  fails("[device]\nbudget = \"1 GiB\"\n[storage]\nblock = \"1000 B\"\n",
        "my.toml:4: [storage] block: must be a multiple of 4 KiB");
  fails("[device]\nbudget = \"1 GiB\"\n[storage]\nqueue_depth = 0\n", "[storage] queue_depth");
  fails("[device]\nbudget = \"1 GiB\"\n[storage]\npath = \"\"\n", "[storage] path: must name a directory");
  fails("[device]\nbudget = \"1 GiB\"\n[storage]\ncache = \"1 GiB\"\n", "cache");
  fails("[device]\nbudget = \"1 GiB\"\n[storage]\ntimeout = \"0 s\"\n", "[storage] timeout");
  fails("[device]\nbudget = \"1 GiB\"\n[storage]\ntimeout = \"1e17 s\"\n", "[storage] timeout: must be 1 ms to a year");
}

TEST(config, errors_name_the_file_the_line_and_the_key)
{
  fails("[device]\nbudget = \"1 GiB\"\nbugdet = 3\n", "my.toml:3: [device] has no key 'bugdet'");
  fails("[device]\nbudget = 1024\n", "my.toml:2: [device] budget: expected a quantity with a unit");
  fails("[device]\nbudget = \"1024\"\n", "my.toml:2: [device] budget: \"1024\" is not a quantity with a unit");
  fails("[device]\nbudget = \"1 GiB\"\n[defaults]\nresidency = \"sometimes\"\n",
        "my.toml:4: [defaults] residency: unknown value \"sometimes\"; use pinned | prefetch | on_demand");
  fails("[device]\nbudget = \"1 GiB\"\n[defaults]\nlookahead = \"2\"\n",
        "my.toml:4: [defaults] lookahead: expected an integer, found a string");
  fails("[device]\nbudget = \"1 GiB\"\n[[units]]\nresidency = \"pinned\"\n", "my.toml:3: [[units]] needs match");
  fails("[device]\nbudget = \"1 GiB\"\n[optimiser]\nlr = 1\n", "my.toml:3: unknown key 'optimiser'");
  fails("[device]\nbudget = \"1 GiB\"\n[optimizer]\nbetas = [0.9]\n", "my.toml:4: [optimizer] betas: expected two");
  fails("[device]\nbudget = \"1 GiB\"\n[optimizer]\nlr = -1.0\n", "my.toml:4: [optimizer] lr: must be a positive");
  fails("[device]\nbackend = \"emulated\"\n", "[device] budget is missing");
  fails("[device\nbudget = 1\n", "my.toml:1:");
  fails("[device]\nbackend = \"emulated\"\nbudget = \"1 GiB\"\nlink_bandwidth = \"0 GB/s\"\n",
        "my.toml:4: [device] link_bandwidth: \"0 GB/s\" must be more than zero");
  fails("[device]\nbackend = \"emulated\"\nbudget = \"1 GiB\"\nlink_bandwidth = \"-1 GB/s\"\n",
        "my.toml:4: [device] link_bandwidth: \"-1 GB/s\" is not a quantity");
}

TEST(config, a_directory_or_a_fifo_is_named_as_such)
{
  const std::string dir = ::testing::TempDir() + "taskswap_config_dir";
  std::filesystem::create_directories(dir);
  expect_error_mentioning<config_error>([&] { (void)load_config(dir); },
                                        "' is a directory; give the path of a TOML file");
  const std::string fifo = ::testing::TempDir() + "taskswap_config_fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error_mentioning<config_error>([&] { (void)load_config(fifo); }, "' is not a regular file");
  std::filesystem::remove(fifo);
}

TEST(config, error_texts_name_source_locations_inside_the_project)
{
  // A precondition failure names the file:line of its check relative to the project tree, never
  // the build machine's absolute path.
  expect_error_mentioning<invalid_argument>([] { (void)emulated_device({.memory_bytes = 0, .link = {}}); },
                                            " [device/device.cpp:");
}

TEST(config, a_missing_file_is_named)
{
  expect_error_mentioning<config_error>([] { (void)load_config("/nonexistent/taskswap.toml"); },
                                        "the configuration '/nonexistent/taskswap.toml' does not exist");
  const std::string file = ::testing::TempDir() + "taskswap_config_test.toml";
  std::ofstream(file) << "[device]\nbackend = \"emulated\"\nbudget = \"64 MiB\"\n";
  EXPECT_EQ(load_config(file).device.budget, std::size_t{64} << 20);
}

}  // namespace
}  // namespace taskswap::test
