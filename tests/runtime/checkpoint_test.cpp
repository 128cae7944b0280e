// SPDX-License-Identifier: Apache-2.0
// Checkpoints: bitwise resume, and every way a checkpoint can be bad (corrupted, partial, of
// other units) refused before anything changes; a failed save leaves the old checkpoint.

#include "expect_error.hpp"
#include "file_size_limit.hpp"
#include "runtime/training_loop.hpp"
#include "storage/crc32c.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

namespace taskswap::test {
namespace {

namespace fs = std::filesystem;

// A trunk (f32, pinned) and four task units (bf16 prefetched with device AdamW, f32 with host
// AdamW), in a 1 MiB budget that holds two task units at a time.
std::vector<unit_spec> units(std::size_t task_elements = 20'000)
{
  std::vector<unit_spec> u;
  u.push_back({.name = "trunk", .tensors = {{"w", {64, 64}}, {"b", {64}}}, .compute = dtype::f32});
  u.back().policy = unit_policy{residency::pinned, 0, optimizer_placement::device};
  for (int t = 0; t < 4; ++t) {
    u.push_back({.name = "task/" + std::to_string(t),
                 .tensors = {{"w", {task_elements}}},
                 .compute = t % 2 == 0 ? dtype::bf16 : dtype::f32,
                 .grad = dtype::f32});
    u.back().policy =
      unit_policy{residency::prefetch, 1, t % 2 == 0 ? optimizer_placement::device : optimizer_placement::host};
  }
  return u;
}

runtime_options options()
{
  runtime_options o;
  o.device = {.backend = backend_kind::emulated, .budget = std::size_t{1} << 20U};
  o.optimizer.lr = 1e-2;
  return o;
}

struct model {
  device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
  stream s{dev};
  runtime rt;
  explicit model(const std::vector<unit_spec>& u = units()) : rt(dev, options(), u)
  {
    for (std::size_t i = 0; i < rt.unit_count(); ++i) {
      const home_view h = rt.home({static_cast<std::uint32_t>(i)});
      auto* m = static_cast<float*>(h.master.data);
      for (std::size_t k = 0; k < h.master.count; ++k) {
        m[k] = 0.01F * static_cast<float>((k * 7 + i * 13) % 101) - 0.5F;
      }
    }
  }

  // Steps [first, end): the trunk and task (step % 4), gradients a function of (unit, step).
  void train(std::uint64_t first, std::uint64_t end)
  {
    for (std::uint64_t step = first; step < end; ++step) {
      const unit_id trunk = rt.find("trunk");
      const unit_id task = rt.find("task/" + std::to_string(step % 4));
      rt.plan(step_plan{trunk, task});
      train_step(rt, s, {trunk, task}, step);
    }
  }

  // Every unit's home slabs and step, as bytes.
  std::string state() { return home_state(rt); }
  // The home slabs without flushing (a runtime that has not started may not flush).
  std::string raw_state()
  {
    std::string out;
    for (std::size_t i = 0; i < rt.unit_count(); ++i) {
      const home_view h = rt.home({static_cast<std::uint32_t>(i)});
      for (const slab_view& v : {h.master, h.m, h.v}) { out.append(static_cast<const char*>(v.data), v.bytes()); }
    }
    return out;
  }
};

fs::path test_root() { return fs::temp_directory_path() / ("taskswap-checkpoint-test-" + std::to_string(::getpid())); }

struct remove_test_root {
  ~remove_test_root()
  {
    std::error_code ec;
    fs::remove_all(test_root(), ec);
  }
} const cleanup_at_exit;

fs::path fresh_dir(const std::string& name)
{
  // A directory of its own per test, so that what lies beside the checkpoint can be counted.
  const fs::path p = test_root() / name / "ck";
  fs::remove_all(p.parent_path());
  fs::create_directories(p.parent_path());
  return p;
}

std::string read_text(const fs::path& p)
{
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& p, const std::string& text)
{
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

TEST(checkpoint, resuming_gives_bitwise_the_parameters_of_an_uninterrupted_run)
{
  model uninterrupted;
  uninterrupted.train(0, 24);
  const std::string want = uninterrupted.state();

  const fs::path dir = fresh_dir("resume");
  {
    model first;
    first.train(0, 11);
    first.rt.save_checkpoint(dir, {{"sampler", "step 11"}});
  }
  model resumed;
  resumed.rt.set_optimizer(
    {.lr = 0.5, .beta1 = 0.5, .beta2 = 0.5, .eps = 1.0, .weight_decay = 0.5});  // the load restores them
  const checkpoint_manifest m = resumed.rt.load_checkpoint(dir);
  EXPECT_EQ(m.steps_done, 11U);
  EXPECT_EQ(m.user.at("sampler"), "step 11");
  EXPECT_EQ(m.units.size(), 5U);
  resumed.train(11, 24);
  EXPECT_EQ(resumed.state(), want) << "home slabs after resuming differ from the uninterrupted run";
  EXPECT_EQ(resumed.rt.stats().steps.back().step, 23U) << "the plan position continues";
}

TEST(checkpoint, saving_again_replaces_the_checkpoint_only_when_complete_and_a_failed_save_loses_nothing)
{
  const fs::path dir = fresh_dir("replace");
  model a;
  a.train(0, 5);
  a.rt.save_checkpoint(dir);
  a.train(5, 9);
  a.rt.save_checkpoint(dir);
  EXPECT_EQ(read_checkpoint_manifest(dir).steps_done, 9U);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.parent_path()), fs::directory_iterator{}), 1)
    << "no temporary directory is left beside it";

  // A write that fails (the file size limit) leaves the old checkpoint as it was.
  a.train(9, 12);
  {
    const file_size_limit limit(64 * 1024);
    expect_error_mentioning<checkpoint_error>([&] { a.rt.save_checkpoint(dir); }, "failed");
  }
  verify_checkpoint(dir);
  EXPECT_EQ(read_checkpoint_manifest(dir).steps_done, 9U);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.parent_path()), fs::directory_iterator{}), 1);

  // "ck/" names "ck"; a temporary directory of a save that died (its pid is gone) is cleared away.
  const fs::path stale = dir.parent_path() / ".ck.tmp-999999999";
  fs::create_directories(stale);
  a.rt.save_checkpoint(dir.string() + "/");
  EXPECT_EQ(read_checkpoint_manifest(dir).steps_done, 12U);
  EXPECT_FALSE(fs::exists(stale));

  // A directory that is not a checkpoint is never replaced, even if it has a manifest.toml.
  const fs::path lookalike = fresh_dir("lookalike");
  fs::create_directories(lookalike);
  write_text(lookalike / "manifest.toml", "title = 'my notes'\n");
  expect_error_mentioning<checkpoint_error>([&] { a.rt.save_checkpoint(lookalike); }, "is not a taskswap checkpoint");
  EXPECT_EQ(read_text(lookalike / "manifest.toml"), "title = 'my notes'\n");

  // A directory that is not a checkpoint is never replaced.
  const fs::path other = fresh_dir("not-a-checkpoint");
  fs::create_directories(other);
  write_text(other / "notes.txt", "mine");
  expect_error_mentioning<checkpoint_error>([&] { a.rt.save_checkpoint(other); }, "is not a taskswap checkpoint");
  EXPECT_EQ(read_text(other / "notes.txt"), "mine");
}

TEST(checkpoint, a_corrupted_or_partial_checkpoint_is_refused_and_nothing_changes)
{
  const fs::path dir = fresh_dir("bad");
  {
    model a;
    a.train(0, 6);
    a.rt.save_checkpoint(dir);
  }
  const std::string data = read_text(dir / "data.bin");
  const std::string manifest = read_text(dir / "manifest.toml");
  const checkpoint_manifest m = read_checkpoint_manifest(dir);
  const auto refused = [&](const std::string& needle) {
    model fresh;
    const std::string before = fresh.raw_state();
    expect_error_mentioning<checkpoint_error>([&] { (void)fresh.rt.load_checkpoint(dir); }, needle);
    EXPECT_EQ(fresh.raw_state(), before) << "a refused load changed the home copies";
    fresh.train(0, 1);  // and the runtime still works
  };

  // One bit flipped in task/2's m.
  const checkpoint_unit& u =
    *std::find_if(m.units.begin(), m.units.end(), [](const auto& x) { return x.name == "task/2"; });
  std::string flipped = data;
  flipped[u.m.offset + 5] = static_cast<char>(flipped[u.m.offset + 5] ^ 0x10);
  write_text(dir / "data.bin", flipped);
  refused("unit 'task/2' slab m");
  refused("the checkpoint is corrupted");

  // data.bin cut short: a save that stopped (or a copy that did).
  write_text(dir / "data.bin", data.substr(0, data.size() / 2));
  refused("it is incomplete");

  // No manifest: the save never finished.
  write_text(dir / "data.bin", data);
  fs::remove(dir / "manifest.toml");
  refused("is not a complete checkpoint");

  // The manifest changed by hand: its checksums no longer match.
  std::string edited = manifest;
  const auto at = edited.find("crc32c = ") + 9;
  const auto end = edited.find('\n', at);
  const std::uint64_t crc = std::stoull(edited.substr(at, end - at));
  edited.replace(at, end - at, std::to_string(crc ^ 1U));
  write_text(dir / "manifest.toml", edited);
  refused("has CRC-32C");

  write_text(dir / "manifest.toml", manifest);
  model good;
  EXPECT_EQ(good.rt.load_checkpoint(dir).steps_done, 6U);
}

TEST(checkpoint, a_checkpoint_of_other_units_is_refused_naming_the_unit_and_what_differs)
{
  const fs::path dir = fresh_dir("other");
  {
    model a;
    a.rt.save_checkpoint(dir);
  }
  {
    model wider(units(30'000));
    expect_error_mentioning<checkpoint_error>(
      [&] { (void)wider.rt.load_checkpoint(dir); },
      "unit 'task/0' tensor 0 is 'w' [20000] in the checkpoint but 'w' [30000] in this runtime");
  }
  {
    auto u = units();
    u.pop_back();
    model fewer(u);
    expect_error_mentioning<checkpoint_error>([&] { (void)fewer.rt.load_checkpoint(dir); },
                                              "has unit 'task/3', which this runtime does not register");
  }
  {
    auto u = units();
    u[1].compute = dtype::f32;
    model other_dtype(u);
    expect_error_mentioning<checkpoint_error>([&] { (void)other_dtype.rt.load_checkpoint(dir); },
                                              "unit 'task/0' is bf16 in the checkpoint but f32 in this runtime");
  }
  {
    auto u = units();
    u[4].name = "task/9";
    model renamed(u);
    expect_error_mentioning<checkpoint_error>([&] { (void)renamed.rt.load_checkpoint(dir); }, "has no unit 'task/9'");
  }
  {
    // Policies and placements may change between runs.
    auto u = units();
    for (unit_spec& s : u) { s.policy = unit_policy{residency::on_demand, 0, optimizer_placement::host}; }
    model replaced(u);
    EXPECT_NO_THROW((void)replaced.rt.load_checkpoint(dir));
  }
  model started;
  started.train(0, 1);
  expect_error_mentioning<invalid_argument>([&] { (void)started.rt.load_checkpoint(dir); }, "before the first plan");
}

TEST(checkpoint_manifest, the_reader_refuses_what_is_not_a_manifest_with_the_line)
{
  const fs::path dir = fresh_dir("manifest");
  {
    model a;
    a.rt.save_checkpoint(dir);
  }
  const std::string text = read_text(dir / "manifest.toml");
  EXPECT_NO_THROW((void)parse_checkpoint_manifest(text, "m.toml"));
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  expect_error_mentioning<checkpoint_error>(
    [&] { (void)parse_checkpoint_manifest(replaced("version = 1", "version = 3"), "m.toml"); },
    "this taskswap reads versions 1 to 2");
  // Host homes only: version 1, which taskswap before unit files reads too.
  EXPECT_NO_THROW((void)parse_checkpoint_manifest(replaced("version = 1", "version = 2"), "m.toml"));
  const auto with_file = [&](std::string_view file, std::string_view version) {
    std::string t = replaced("step = ", "file = " + std::string(file) + "\nstep = ");
    return t.replace(t.find("version = 1"), 11, "version = " + std::string(version));
  };
  for (const std::string_view file : {"'../data.bin'", "'/etc/passwd'", "''", "'..'"}) {
    expect_error_mentioning<checkpoint_error>([&] { (void)parse_checkpoint_manifest(with_file(file, "2"), "m.toml"); },
                                              "file: give the name of a file in units/");
  }
  expect_error_mentioning<checkpoint_error>(
    [&] { (void)parse_checkpoint_manifest(with_file("'a.unit'", "1"), "m.toml"); },
    "version 1 checkpoints have no unit files");
  expect_error_mentioning<checkpoint_error>(
    [&] { (void)parse_checkpoint_manifest(replaced("world = 1", "world = 1\nwrold = 2"), "m.toml"); },
    "has an unknown key 'wrold'");
  expect_error_mentioning<checkpoint_error>(
    [&] { (void)parse_checkpoint_manifest(replaced("format = 'taskswap-checkpoint'", "format = 'zip'"), "m.toml"); },
    "not a taskswap checkpoint");
  expect_error_mentioning<checkpoint_error>(
    [&] { (void)parse_checkpoint_manifest(replaced("offset = 0", "offset = 1"), "m.toml"); }, "overlaps");
  const checkpoint_manifest m = parse_checkpoint_manifest(text, "m.toml");
  expect_error_mentioning<checkpoint_error>(
    [&] {
      (void)parse_checkpoint_manifest(
        replaced("data_bytes = " + std::to_string(m.data_bytes), "data_bytes = " + std::to_string(m.data_bytes - 1)),
        "m.toml");
    },
    "reaches beyond data.bin");
  expect_error_mentioning<checkpoint_error>([&] { (void)parse_checkpoint_manifest("units = [", "m.toml"); },
                                            "m.toml:1");
}

TEST(crc32c, matches_the_standard_check_value_and_the_portable_table)
{
  const std::string check = "123456789";
  EXPECT_EQ(detail::crc32c(std::as_bytes(std::span(check.data(), check.size()))), 0xe3069283U);
  EXPECT_EQ(detail::crc32c_portable(std::as_bytes(std::span(check.data(), check.size()))), 0xe3069283U);
  std::mt19937 rng(3);
  std::vector<std::byte> data(100'003);
  for (std::byte& b : data) { b = static_cast<std::byte>(rng()); }
  for (const std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{7}}) {
    for (const std::size_t n : std::vector<std::size_t>{0, 1, 7, 8, 9, 4096, 99'000}) {
      const std::span<const std::byte> s(data.data() + offset, n);
      ASSERT_EQ(detail::crc32c(s), detail::crc32c_portable(s)) << offset << " " << n;
    }
  }
  // Extending equals computing at once.
  const std::span<const std::byte> all(data);
  EXPECT_EQ(detail::crc32c(all.subspan(500), detail::crc32c(all.first(500))), detail::crc32c(all));
}

}  // namespace
}  // namespace taskswap::test
