// SPDX-License-Identifier: Apache-2.0
// The sample model's configuration, units, sampler and the device bytes it takes beside the
// budget (what `taskswap plan` and `headroom` predict the largest batch from).

#include "expect_error.hpp"
#include "model.hpp"

#include <gtest/gtest.h>

#include <set>

namespace {

using taskswap::test::expect_error_mentioning;

constexpr std::string_view base = R"(
[device]
backend = "emulated"
budget = "4 MiB"
[[units]]
match = "trunk/*"
residency = "pinned"
)";

multitask::configuration parse(std::string_view model)
{
  return multitask::parse_configuration(std::string(base) + std::string(model), "test.toml");
}

TEST(multitask_config, reads_the_model_table_beside_the_runtime_sections)
{
  const auto c = parse("[model]\ntasks = 5\ntrunk_layers = 3\ndtype = \"bf16\"\nbatch = 64\nseed = 9\n"
                       "freeze_trunk_after = 40\n");
  EXPECT_EQ(c.model.freeze_trunk_after, 40);
  EXPECT_FALSE(c.model.trunk_frozen(39));
  EXPECT_TRUE(c.model.trunk_frozen(40));
  EXPECT_FALSE(parse("").model.trunk_frozen(1'000'000)) << "0: never";
  EXPECT_EQ(c.model.tasks, 5);
  EXPECT_EQ(c.model.trunk_layers, 3);
  EXPECT_EQ(c.model.compute, taskswap::dtype::bf16);
  EXPECT_EQ(c.model.batch, 64);
  EXPECT_EQ(c.model.seed, 9U);
  EXPECT_EQ(c.runtime.device.budget, std::size_t{4} << 20U);
  ASSERT_EQ(c.runtime.units.size(), 1U);
}

TEST(multitask_config, errors_name_the_line_and_the_key)
{
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[model]\ntasks = 5\nlayers = 3\n"); },
                                                  "test.toml:10: [model] has no key 'layers'");
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[model]\ndtype = \"f64\"\n"); },
                                                  "[model] dtype: use \"f32\", \"bf16\" or \"f16\"");
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[model]\nbatch = 0\n"); },
                                                  "[model] batch: give an integer of at least 1");
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[modle]\n"); }, "unknown key 'modle'");
  expect_error_mentioning<taskswap::config_error>([] { (void)multitask::load_configuration("/nonexistent.toml"); },
                                                  "the configuration '/nonexistent.toml' does not exist");
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[model]\nwidth = 99999999999\n"); },
                                                  "[model] width: 99999999999 is too large; give at most 1073741824");
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[activations]\noffload = \"disk\"\n"); },
                                                  "test.toml:9: [activations] offload: use \"host\"");
}

TEST(multitask_model, offloaded_activations_are_two_blocks_per_layer_of_the_batch_after_the_adapters)
{
  EXPECT_FALSE(parse("").model.offload_activations);
  EXPECT_FALSE(parse("[activations]\noffload = \"none\"\n").model.offload_activations);
  multitask::model_config m = parse("[activations]\noffload = \"host\"\n").model;
  ASSERT_TRUE(m.offload_activations);
  m.tasks = 3;
  m.trunk_layers = 2;
  const auto units = multitask::model_units(m, 96);
  ASSERT_EQ(units.size(), 2U + 3U + 4U);
  EXPECT_EQ(units[5].name, "act/0/input");
  EXPECT_EQ(units[8].name, "act/1/branch");
  for (std::size_t u = 5; u < units.size(); ++u) {
    EXPECT_TRUE(units[u].activation);
    EXPECT_EQ(units[u].tensors.at(0).shape, (std::vector<std::size_t>{96, 128})) << "batch rows of the width";
  }
  // The workspace keeps h_L alone of the trunk's activations (five per-sample buffers fewer: h_0,
  // h_1 and the two branches at 128 floats, 512 bytes each).
  multitask::model_config kept = m;
  kept.offload_activations = false;
  EXPECT_EQ(multitask::model_workspace(kept, 10).per_sample - multitask::model_workspace(m, 10).per_sample,
            4U * 128U * 4U);
}

TEST(multitask_model, units_are_the_trunk_layers_then_the_adapters)
{
  multitask::model_config m;
  m.tasks = 3;
  m.trunk_layers = 2;
  const auto units = multitask::model_units(m);
  ASSERT_EQ(units.size(), 5U);
  EXPECT_EQ(units[0].name, "trunk/0");
  EXPECT_EQ(units[2].name, "task/0");
  ASSERT_EQ(units[2].tensors.size(), 4U);
  EXPECT_EQ(units[2].tensors[0].shape, (std::vector<std::size_t>{128, 256}));
  EXPECT_EQ(units[2].tensors[2].shape, (std::vector<std::size_t>{256, 32}));
}

TEST(multitask_model, the_sampler_is_deterministic_and_reaches_every_task_on_every_rank)
{
  multitask::model_config m;
  m.tasks = 16;
  for (int rank = 0; rank < 2; ++rank) {
    std::set<int> seen;
    for (int s = 0; s < 400; ++s) {
      const int t = multitask::task_of_step(m, rank, s);
      ASSERT_EQ(t, multitask::task_of_step(m, rank, s));
      ASSERT_GE(t, 0);
      ASSERT_LT(t, 16);
      seen.insert(t);
    }
    EXPECT_EQ(seen.size(), 16U);
  }
  int same = 0;
  for (int s = 0; s < 400; ++s) {
    same += multitask::task_of_step(m, 0, s) == multitask::task_of_step(m, 1, s) ? 1 : 0;
  }
  EXPECT_LT(same, 100) << "ranks sample their own tasks";
}

TEST(multitask_model, a_mixed_step_trains_distinct_tasks_over_rows_split_evenly_and_plans_every_adapter)
{
  multitask::model_config m;
  m.tasks = 6;
  m.tasks_per_step = 4;
  std::set<int> seen;
  for (std::int64_t s = 0; s < 200; ++s) {
    const std::vector<int> t = multitask::tasks_of_step(m, 0, s);
    ASSERT_EQ(t.size(), 4U);
    EXPECT_EQ(t.front(), multitask::task_of_step(m, 0, s)) << "the first is the one-task sampler's";
    EXPECT_EQ(std::set<int>(t.begin(), t.end()).size(), 4U) << "distinct";
    seen.insert(t.begin(), t.end());
  }
  EXPECT_EQ(seen.size(), 6U);
  // 10 rows among 4 tasks: 2, 3, 2, 3, covering [0, 10) without overlap.
  EXPECT_EQ(
    (std::vector<int>{multitask::rows_begin(10, 4, 0), multitask::rows_begin(10, 4, 1), multitask::rows_begin(10, 4, 2),
                      multitask::rows_begin(10, 4, 3), multitask::rows_begin(10, 4, 4)}),
    (std::vector<int>{0, 2, 5, 7, 10}));
  const std::vector<taskswap::unit_id> trunk{{0}, {1}};
  const std::vector<taskswap::unit_id> adapters{{5}, {3}};
  const taskswap::step_plan held = multitask::step_plan_of(m, trunk, adapters, 0, false);
  ASSERT_EQ(held.entries().size(), 4U);
  EXPECT_EQ(held.entries()[2].unit.value, 5U);
  EXPECT_EQ(held.entries()[3].unit.value, 3U);
  const taskswap::step_plan streamed = multitask::step_plan_of(m, trunk, adapters, 0, true);
  // forward: acquire+release per layer; each adapter acquired and released (stepped) before the
  // next, as the trainer holds one at a time; backward per layer
  ASSERT_EQ(streamed.entries().size(), 4U + 2U + 2U + 4U);
  const auto e = streamed.entries();
  EXPECT_TRUE(e[4].acquire && e[4].unit.value == 5U && !e[5].acquire && e[5].unit.value == 5U);
  EXPECT_TRUE(e[6].acquire && e[6].unit.value == 3U && !e[7].acquire && e[7].unit.value == 3U);
  expect_error_mentioning<taskswap::config_error>([] { (void)parse("[model]\ntasks = 3\ntasks_per_step = 4\n"); },
                                                  "tasks_per_step = 4 is more than the tasks (3)");
}

TEST(multitask_model, all_resident_pins_every_unit_with_exactly_their_bytes)
{
  const auto c = parse("[model]\ntasks = 4\n");
  const auto units = multitask::model_units(c.model);
  const auto o = multitask::all_resident(c.runtime, units);
  std::size_t bytes = 0;
  for (const auto& u : units) { bytes += taskswap::footprint(u, taskswap::optimizer_placement::device).device_bytes; }
  EXPECT_EQ(o.device.budget, bytes);
  EXPECT_TRUE(o.units.empty());
  EXPECT_EQ(o.defaults.residency, taskswap::residency::pinned);
}

// The trainer takes exactly the budget and its workspace: with a batch whose buffers need no
// padding, a device of budget + workspace holds it and one byte less does not.
TEST(multitask_model, the_workspace_is_what_the_accounting_says)
{
  auto c = parse("[model]\ntasks = 4\nsteps = 64\n");
  const int batch = 64;
  const multitask::workspace_size w = multitask::model_workspace(c.model, c.model.steps);
  const std::size_t per_sample_buffers = 2 * static_cast<std::size_t>(c.model.trunk_layers) + 1 + 5;  // h_0..h_L, r_l
  const std::size_t exact = w.bytes(batch) - 256 * per_sample_buffers;  // no padding at this batch
  c.runtime.device.emulated.memory_bytes = c.runtime.device.budget + exact;
  {
    const taskswap::device dev = taskswap::make_device(c.runtime.device);
    multitask::trainer t(dev, c.runtime, c.model, batch, c.model.steps);
    EXPECT_EQ(dev.memory().free, 0U);
  }
  c.runtime.device.emulated.memory_bytes -= 1;
  const taskswap::device dev = taskswap::make_device(c.runtime.device);
  EXPECT_THROW(multitask::trainer(dev, c.runtime, c.model, batch, c.model.steps), taskswap::out_of_memory);
}

TEST(multitask_model, a_short_run_trains_every_unit)
{
  auto c = parse("[model]\ntasks = 4\nsteps = 40\nbatch = 32\n");
  c.runtime.device.emulated.memory_bytes = std::size_t{64} << 20U;
  const taskswap::device dev = taskswap::make_device(c.runtime.device);
  multitask::trainer t(dev, c.runtime, c.model, c.model.batch, c.model.steps);
  std::vector<std::string> lines;
  const multitask::run_result r = t.run([&](const std::string& l) { lines.push_back(l); });
  EXPECT_EQ(lines.size(), 1U);  // log_every 50 > 40 steps: the final line only
  std::int64_t steps = 0;
  for (const auto& task : r.tasks) { steps += task.steps; }
  EXPECT_EQ(steps, 40);
  EXPECT_EQ(r.timed_steps, 39);
  EXPECT_GT(r.total.swap_ins, 0U);
  for (std::size_t u = 0; u < t.get_runtime().unit_count(); ++u) {
    const auto st = t.get_runtime().stats().units[u];
    EXPECT_GT(st.step, 0) << st.name << " was trained";
  }
}

}  // namespace
