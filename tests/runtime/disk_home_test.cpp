// SPDX-License-Identifier: Apache-2.0
// The disk home tier: units whose homes are unit files behind a host cache train bitwise as
// with host homes, through a cache too small for them, under both optimizer placements; the
// files hold the homes after flush(); checkpoints copy the files and resume bitwise, in either
// tier; a damaged checkpoint is refused before anything is overwritten; and what is
// misconfigured says so.

#include "expect_error.hpp"
#include "file_size_limit.hpp"
#include "storage/checkpoint.hpp"
#include "runtime/training_loop.hpp"
#include "scratch_dir.hpp"
#include "device/message.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace taskswap::test {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t task_elements = 20'000;

// A pinned trunk and six task units (bf16 with device AdamW, f32 with host AdamW, in turn), in a
// 1 MiB budget that holds two task units at a time; with `disk`, the tasks' homes are files.
std::vector<unit_spec> units()
{
  std::vector<unit_spec> u;
  u.push_back({.name = "trunk", .tensors = {{"w", {64, 64}}, {"b", {64}}}, .compute = dtype::f32});
  u.back().policy = unit_policy{residency::pinned, 0, optimizer_placement::device};
  for (int t = 0; t < 6; ++t) {
    u.push_back({.name = "task/" + std::to_string(t),
                 .tensors = {{"w", {task_elements}}, {"b", {100}, true}},
                 .compute = t % 2 == 0 ? dtype::bf16 : dtype::f32,
                 .grad = dtype::f32});
  }
  return u;
}

runtime_options options(const fs::path& storage, std::size_t host_cache)
{
  runtime_options o;
  o.device = {.backend = backend_kind::emulated, .budget = std::size_t{1} << 20U};
  o.optimizer.lr = 1e-2;
  o.optimizer.weight_decay = 0.05;
  unit_rule tasks;
  tasks.match = "task/*";
  tasks.residency = residency::prefetch;
  tasks.lookahead = 1;
  o.units.push_back(tasks);
  unit_rule host_adamw;
  host_adamw.match = "task/[13579]";
  host_adamw.optimizer = optimizer_placement::host;
  o.units.push_back(host_adamw);
  if (!storage.empty()) {
    unit_rule disk;
    disk.match = "task/*";
    disk.home = "disk";
    o.units.push_back(disk);
    o.storage = {.path = storage, .host_cache = host_cache, .queue_depth = 4, .block = 64 * 1024};
  }
  return o;
}

struct model {
  device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
  stream s{dev};
  runtime rt;
  model(const fs::path& storage, std::size_t host_cache, bool initialise = true)
      : rt(dev, options(storage, host_cache), units())
  {
    if (initialise) { initialise_masters(); }
  }
  explicit model(const runtime_options& o) : rt(dev, o, units()) { initialise_masters(); }

  void initialise_masters()
  {
    for (std::size_t i = 0; i < rt.unit_count(); ++i) {
      const home_view h = rt.home({static_cast<std::uint32_t>(i)});
      auto* m = static_cast<float*>(h.master.data);
      for (std::size_t k = 0; k < h.master.count; ++k) {
        m[k] = 0.01F * static_cast<float>((k * 7 + i * 13) % 101) - 0.5F;
      }
    }
  }

  // Steps [from, to): the trunk and a task drawn from the step, planned two steps ahead.
  void train(std::uint64_t to, std::uint64_t from = 0)
  {
    const auto task_of = [&](std::uint64_t step) {
      return rt.find("task/" + std::to_string((step * 5 + step / 3) % 6));
    };
    const unit_id trunk = rt.find("trunk");
    rt.plan(std::vector<step_plan>{step_plan{trunk, task_of(from)}, step_plan{trunk, task_of(from + 1)}});
    for (std::uint64_t step = from; step < to; ++step) {
      rt.plan(std::vector<step_plan>{step_plan{trunk, task_of(step + 2)}});
      train_step(rt, s, {trunk, task_of(step)}, step);
    }
  }

  // Every unit's home slabs and step, as bytes.
  std::string state() { return home_state(rt); }
};

using disk_home_test = scratch_dir_test;

TEST_F(disk_home_test, disk_homes_through_a_small_host_cache_train_bitwise_as_host_homes)
{
  model host({}, 0);
  host.train(40);
  // A task's home is about 320 KiB (device AdamW) or 400 KiB (host AdamW, with its gradients):
  // the cache holds two or three of the six.
  model disk(dir_, 1024 * 1024);
  disk.train(40);
  const disk_stats d = disk.rt.stats().disk;
  EXPECT_EQ(d.host_cache_bytes, std::size_t{1} << 20U);
  EXPECT_GT(d.misses, 6U);  // more than the first read of each
  EXPECT_GT(d.written_back, 0U);
  EXPECT_GT(d.evictions, 0U);
  EXPECT_EQ(host.state(), disk.state());
  EXPECT_EQ(host.rt.stats().disk.misses, 0U);
}

TEST_F(disk_home_test, after_flush_each_unit_file_holds_its_home)
{
  model disk(dir_, 768 * 1024);
  disk.train(12);
  disk.rt.flush();
  std::size_t files = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    ++files;
    EXPECT_EQ(e.path().extension(), ".unit") << e.path();
  }
  EXPECT_EQ(files, 6U);  // the tasks'; the trunk's home is in host memory
  for (int t = 0; t < 6; ++t) {
    const std::string name = "task/" + std::to_string(t);
    const home_view h = disk.rt.home(disk.rt.find(name));
    fs::path file;
    for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
      if (e.path().filename().string().rfind("task%2f" + std::to_string(t) + ".", 0) == 0) { file = e.path(); }
    }
    ASSERT_FALSE(file.empty()) << name;
    std::string bytes(fs::file_size(file), '\0');
    std::ifstream(file, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    // The home block starts with the parameters; the master, m and v follow at their offsets.
    for (const slab_view& v : {h.params, h.master, h.m, h.v}) {
      const auto at =
        static_cast<std::size_t>(static_cast<const std::byte*>(v.data) - static_cast<const std::byte*>(h.params.data));
      ASSERT_LE(at + v.bytes(), bytes.size()) << name;
      EXPECT_EQ(std::memcmp(bytes.data() + at, v.data, v.bytes()), 0) << name << " at " << at;
    }
  }
}

TEST_F(disk_home_test, a_failed_read_or_write_is_one_storage_error_naming_the_file_and_the_unit)
{
  for (const int error : {5 /* EIO */, 28 /* ENOSPC */}) {
    SCOPED_TRACE(error);
    fs::remove_all(dir_);
    const device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
    runtime_options o = options(dir_, 1024 * 1024);
    o.storage.block = 16 * 1024;
    o.storage.fail_request = 60;  // after the first homes are written and read back
    o.storage.fail_errno = error;
    runtime rt(dev, o, units());
    stream s{dev};
    std::string first;
    try {
      for (std::uint64_t step = 0; step < 40; ++step) {
        const unit_id task = rt.find("task/" + std::to_string(step % 6));
        rt.plan(std::vector<step_plan>{step_plan{task}});
        (void)rt.acquire(task, s);
        rt.step(task, s);
        rt.release(task, s);
        (void)rt.end_step();
      }
      rt.flush();
      ADD_FAILURE() << "no storage error";
    } catch (const storage_error& e) {
      first = e.what();
    }
    EXPECT_NE(first.find(dir_.string()), std::string::npos) << first;
    EXPECT_NE(first.find(".unit' (unit 'task/"), std::string::npos) << first;
    EXPECT_NE(first.find(error == 5 ? "Input/output error" : "No space left on device"), std::string::npos) << first;
    // The runtime is failed: every later call says the same, and nothing more is written home.
    expect_error_mentioning<storage_error>([&] { rt.flush(); }, first);
  }
}

// Whatever ends a run with disk homes (a request failing with EIO or ENOSPC, unit files truncated
// under the run, a unit file deleted under the run), the error is one storage_error naming the file and the unit, the
// failed runtime writes nothing over the checkpoint saved before, and that checkpoint resumes
// bitwise, in a new directory and in the failed run's own.
TEST_F(disk_home_test, after_a_fault_the_checkpoint_saved_before_it_resumes_bitwise)
{
  fs::create_directories(dir_);
  std::string expected;
  std::uint64_t at_checkpoint = 0;  // block requests sent by the checkpoint at step 20
  std::uint64_t at_end = 0;  // and by step 40
  {
    model reference(dir_ / "reference", 1 << 20);
    reference.train(20);
    reference.rt.save_checkpoint(dir_ / "ck-reference");
    at_checkpoint = reference.rt.stats().disk.requests;
    reference.train(40, 20);
    at_end = reference.rt.stats().disk.requests;
    expected = reference.state();
  }
  ASSERT_GT(at_checkpoint, 0U);
  ASSERT_GT(at_end, at_checkpoint + 40) << "the steps after the checkpoint are meant to read and write the drive";
  for (const std::string fault : {"EIO", "ENOSPC", "truncated", "deleted"}) {
    SCOPED_TRACE(fault);
    const fs::path run = dir_ / ("run-" + fault);
    const fs::path ck = dir_ / ("ck-" + fault);
    runtime_options o = options(run, 1 << 20);
    // Halfway through the steps after the checkpoint: how many requests a run sends depends on
    // when its copies end (a read ahead takes room only once the copies on it are done), so the
    // fault keeps a wide margin on both sides.
    const std::uint64_t after = at_checkpoint + (at_end - at_checkpoint) / 2;
    if (fault == "EIO" || fault == "ENOSPC") {
      o.storage.fail_request = after;
      o.storage.fail_errno = fault == "EIO" ? 5 : 28;
    }
    std::string what;
    {
      model failing(o);
      failing.train(20);
      failing.rt.save_checkpoint(ck);
      ASSERT_LT(failing.rt.stats().disk.requests, after) << "the fault is meant to come after the checkpoint";
      try {
        const auto unit_files = [&] {
          std::vector<fs::path> files;
          for (const fs::directory_entry& e : fs::directory_iterator(run)) {
            if (e.path().extension() == ".unit") { files.push_back(e.path()); }
          }
          return files;
        };
        if (fault == "truncated") {
          // Every file empty: the cache holds fewer homes than the steps use, so a home not in it
          // is read before its use, and its file ends before the bytes.
          for (const fs::path& f : unit_files()) { fs::resize_file(f, 0); }
          failing.train(40, 20);
        } else if (fault == "deleted") {
          // Right after the checkpoint: a file not written since, which only a check of the
          // files the cache did not write can find.
          const std::vector<fs::path> files = unit_files();
          ASSERT_FALSE(files.empty());
          fs::remove(files.front());
        } else {
          failing.train(40, 20);
        }
        failing.rt.save_checkpoint(dir_ / ("ck-later-" + fault));
        ADD_FAILURE() << "no storage error";
      } catch (const storage_error& e) {
        what = e.what();
      }
      EXPECT_NE(what.find(run.string()), std::string::npos) << what;
      EXPECT_NE(what.find("unit 'task/"), std::string::npos) << what;
      const std::string says = fault == "EIO"         ? "Input/output error"
                               : fault == "ENOSPC"    ? "No space left on device"
                               : fault == "truncated" ? "the file ends before them (a short read"
                                                      : "was deleted while the run used it";
      EXPECT_NE(what.find(says), std::string::npos) << what;
      // The failed runtime refuses to save again, and the checkpoint before the fault is whole.
      expect_error_mentioning<storage_error>([&] { failing.rt.save_checkpoint(ck); }, what);
    }
    EXPECT_NO_THROW(verify_checkpoint(ck));
    for (const fs::path& where : {dir_ / ("resumed-" + fault), run}) {
      model resumed(where, 1 << 20);
      EXPECT_EQ(resumed.rt.load_checkpoint(ck).steps_done, 20U) << where;
      resumed.train(40, 20);
      EXPECT_EQ(resumed.state(), expected) << where;
    }
  }
}

TEST_F(disk_home_test, what_is_missing_or_not_supported_yet_says_so)
{
  const device dev = emulated_device({.memory_bytes = std::size_t{1} << 20U, .link = {}});
  runtime_options no_path = options(dir_, 1 << 20);
  no_path.storage.path.clear();
  expect_error_mentioning<config_error>([&] { runtime rt(dev, no_path, units()); }, "[storage] path is missing");
  runtime_options no_cache = options(dir_, 1 << 20);
  no_cache.storage.host_cache = 0;
  expect_error_mentioning<config_error>([&] { runtime rt(dev, no_cache, units()); }, "host_cache is missing");
  expect_error_mentioning<config_error>([&] { runtime rt(dev, options(dir_, 64 * 1024), units()); },
                                        "raise host_cache to at least the largest disk-homed unit");
}

// The bytes of a file.
std::string file_bytes(const fs::path& file)
{
  std::string bytes(fs::file_size(file), '\0');
  std::ifstream(file, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return bytes;
}

TEST_F(disk_home_test, a_checkpoint_copies_the_unit_files_and_resumes_bitwise_in_either_tier)
{
  const fs::path ck = dir_ / "ck";
  const fs::path ck_host = dir_ / "ck-host";
  fs::create_directories(dir_);
  std::string expected;
  {
    model host({}, 0);
    host.train(20);
    host.rt.save_checkpoint(ck_host);
    host.train(40, 20);
    expected = host.state();
  }
  {
    model disk(dir_ / "a", 1 << 20);
    disk.train(20);
    disk.rt.save_checkpoint(ck);
    disk.train(40, 20);
    EXPECT_EQ(disk.state(), expected);
  }
  // The disk homes are copies of their unit files in units/; only the trunk is in data.bin.
  const checkpoint_manifest m = read_checkpoint_manifest(ck);
  std::size_t own_files = 0;
  for (const checkpoint_unit& u : m.units) {
    EXPECT_EQ(u.file.empty(), u.name == "trunk") << u.name;
    if (!u.file.empty()) {
      ++own_files;
      EXPECT_TRUE(fs::exists(ck / "units" / u.file)) << u.file;
      EXPECT_EQ(fs::file_size(ck / "units" / u.file), fs::file_size(dir_ / "a" / u.file)) << u.file;
    }
  }
  EXPECT_EQ(own_files, 6U);
  EXPECT_EQ(fs::file_size(ck / "data.bin"), m.data_bytes);
  EXPECT_NO_THROW(verify_checkpoint(ck));
  // Resumed with disk homes: in a new directory; in the old one, whose files are 20 steps later
  // and whose blocks the initial values were just written into; with host homes; and from the
  // host run's checkpoint.
  for (const auto& [storage, from] : {std::pair{dir_ / "b", ck}, std::pair{dir_ / "a", ck}, std::pair{fs::path{}, ck},
                                      std::pair{dir_ / "c", ck_host}}) {
    model resumed(storage, 1 << 20);
    EXPECT_EQ(resumed.rt.load_checkpoint(from).steps_done, 20U);
    resumed.train(40, 20);
    EXPECT_EQ(resumed.state(), expected) << storage << " from " << from;
  }
}

// A resumed run's homes are the checkpoint's, whose bf16 params are derived from the master
// already: its start reads and writes no unit file (it used to read every bf16 home to derive
// them again, which for thousands of disk homes is a pass over the drive).
TEST_F(disk_home_test, a_resumed_run_starts_without_reading_its_unit_files)
{
  const fs::path ck = dir_ / "ck";
  fs::create_directories(dir_);
  std::string expected;
  {
    model disk(dir_ / "a", 1 << 20);
    disk.train(6);
    disk.rt.save_checkpoint(ck);
    disk.train(12, 6);
    expected = disk.state();
  }
  model resumed(dir_ / "b", 1 << 20, false);
  EXPECT_EQ(resumed.rt.load_checkpoint(ck).steps_done, 6U);
  resumed.rt.plan(std::vector<step_plan>{});  // starts the runtime; nothing planned to read ahead
  const disk_stats d = resumed.rt.stats().disk;
  EXPECT_EQ(d.read_bytes, 0U);
  EXPECT_EQ(d.misses, 0U);
  EXPECT_EQ(d.cached_bytes, 0U);
  resumed.train(12, 6);
  EXPECT_EQ(resumed.state(), expected);
}

TEST_F(disk_home_test, a_damaged_checkpoint_is_refused_before_any_unit_file_is_written)
{
  const fs::path ck = dir_ / "ck";
  fs::create_directories(dir_);
  model disk(dir_ / "a", 1 << 20);
  disk.train(10);
  disk.rt.save_checkpoint(ck);
  const std::string saved = disk.state();
  const checkpoint_manifest m = read_checkpoint_manifest(ck);
  const fs::path victim = ck / "units" / m.units.back().file;
  const std::string original = file_bytes(victim);
  {
    std::string bytes = original;
    bytes[m.units.back().m.offset + 3] ^= 0x40;
    std::ofstream(victim, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  expect_error_mentioning<checkpoint_error>([&] { verify_checkpoint(ck); }, "slab m");
  {
    // Refused at the checks: the runtime's homes and files are as they were.
    model target(dir_ / "c", 1 << 20);
    const auto files = [&] {
      std::string all;
      for (const fs::directory_entry& e : fs::directory_iterator(dir_ / "c")) { all += file_bytes(e.path()); }
      return all;
    };
    const std::string before = files();
    expect_error_mentioning<checkpoint_error>([&] { (void)target.rt.load_checkpoint(ck); }, "has CRC-32C");
    EXPECT_EQ(files(), before);
    EXPECT_EQ(target.state(), model(dir_ / "d", 1 << 20).state());
  }
  fs::remove(victim);
  expect_error_mentioning<checkpoint_error>([&] { (void)model(dir_ / "c", 1 << 20).rt.load_checkpoint(ck); },
                                            "has no file units/" + m.units.back().file);
  std::ofstream(victim, std::ios::binary).write(original.data(), static_cast<std::streamsize>(original.size()));
  model resumed(dir_ / "c", 1 << 20);
  (void)resumed.rt.load_checkpoint(ck);
  EXPECT_EQ(resumed.state(), saved);
}

// Each way of copying a unit file into a checkpoint, forced, on a size that is not a multiple of
// the buffer (8 MiB) or of a page: the bytes arrive whole, and the copy never overwrites a file.
TEST_F(disk_home_test, each_way_of_copying_a_unit_file_copies_it_whole)
{
  fs::create_directories(dir_);
  const fs::path from = dir_ / "from.unit";
  std::string bytes((std::size_t{8} << 20U) * 2 + 3 * 4096 + 17, '\0');
  std::mt19937_64 rng(5);
  for (char& c : bytes) { c = static_cast<char>(rng()); }
  std::ofstream(from, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  for (const detail::file_copy way :
       {detail::file_copy::clone, detail::file_copy::in_kernel, detail::file_copy::buffered}) {
    const fs::path to = dir_ / ("to-" + std::to_string(static_cast<int>(way)) + ".unit");
    detail::copy_unit_file(from, to, way);
    EXPECT_TRUE(file_bytes(to) == bytes) << static_cast<int>(way);
    expect_error_mentioning<checkpoint_error>([&] { detail::copy_unit_file(from, to, way); }, to.string());
  }
}

// A save that fails while it copies the unit files (here: the file size limit, met by the copies
// and not by data.bin, which holds the trunk alone) leaves the last checkpoint as it was and no
// temporary directory; the run goes on and its next save works.
TEST_F(disk_home_test, a_save_failing_while_it_copies_the_unit_files_keeps_the_last_checkpoint)
{
  const fs::path ck = dir_ / "ck";
  fs::create_directories(dir_);
  model disk(dir_ / "a", 1 << 20);
  disk.train(10);
  disk.rt.save_checkpoint(ck);
  const std::string at_10 = disk.state();
  disk.train(20, 10);
  disk.rt.flush();  // nothing left for the save's own flush to write under the limit
  {
    const file_size_limit limit(96 * 1024);  // the trunk's data.bin fits; a task's unit file does not
    expect_error_mentioning<checkpoint_error>([&] { disk.rt.save_checkpoint(ck); }, "copying");
  }
  EXPECT_NO_THROW(verify_checkpoint(ck));
  EXPECT_EQ(read_checkpoint_manifest(ck).steps_done, 10U);
  std::size_t entries = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    ++entries;
    EXPECT_TRUE(e.path() == ck || e.path() == dir_ / "a") << "left behind: " << e.path();
  }
  EXPECT_EQ(entries, 2U);
  {
    model resumed(dir_ / "b", 1 << 20);
    (void)resumed.rt.load_checkpoint(ck);
    EXPECT_EQ(resumed.state(), at_10);
  }
  const std::string at_20 = disk.state();
  disk.rt.save_checkpoint(ck);
  EXPECT_EQ(read_checkpoint_manifest(ck).steps_done, 20U);
  model resumed(dir_ / "c", 1 << 20);
  (void)resumed.rt.load_checkpoint(ck);
  EXPECT_EQ(resumed.state(), at_20);
}

TEST_F(disk_home_test, two_runs_cannot_share_a_storage_directory)
{
  model first(dir_, 1 << 20);
  expect_error_mentioning<config_error>([&] { model second(dir_, 1 << 20); },
                                        "another run (or rank) uses this directory");
}

TEST_F(disk_home_test, a_run_that_never_uses_a_unit_flushes_its_file_as_zeros)
{
  {
    model disk(dir_, 1 << 20);
    disk.train(6);
    disk.rt.flush();
  }
  model untouched(dir_, 1 << 20, false);  // the files hold the last run's homes
  untouched.rt.flush();
  std::size_t files = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const std::string bytes = file_bytes(e.path());
    EXPECT_EQ(bytes.find_first_not_of('\0'), std::string::npos) << e.path();
    ++files;
  }
  EXPECT_EQ(files, 6U);
}

// Two task units take turns, both resident on the device from their first use (the budget holds
// two), behind a cache that holds one home, with the device keeping up with the trainer.
void take_turns(model& m, const char* a, const char* b, std::uint64_t from, std::uint64_t to)
{
  const unit_id trunk = m.rt.find("trunk");
  const auto task_of = [&](std::uint64_t step) { return m.rt.find(step % 2 == 0 ? a : b); };
  if (from == 0) { m.rt.plan(std::vector<step_plan>{step_plan{trunk, task_of(0)}, step_plan{trunk, task_of(1)}}); }
  for (std::uint64_t step = from; step < to; ++step) {
    m.rt.plan(std::vector<step_plan>{step_plan{trunk, task_of(step + 2)}});
    train_step(m.rt, m.s, {trunk, task_of(step)}, step);
    m.s.synchronize();  // the device keeps up: the swap-ins' cache blocks are idle at the reads ahead
  }
}

// With device AdamW, once both are resident nothing more is read: the reads ahead skip a unit
// whose device copy serves its next use (that home is older than the copy; before, 4 of the 18
// later steps read the other unit's home), and the results are those of host homes.
TEST_F(disk_home_test, a_home_whose_device_copy_serves_its_next_use_is_not_read_ahead)
{
  model host({}, 0);
  take_turns(host, "task/0", "task/2", 0, 20);
  model disk(dir_, 450 * 1024);  // one home: the largest (a host-AdamW task's, about 400 KiB) must fit
  take_turns(disk, "task/0", "task/2", 0, 2);
  const disk_stats both_resident = disk.rt.stats().disk;
  EXPECT_GT(both_resident.read_bytes, 0U);  // the first swap-ins read the initial values
  take_turns(disk, "task/0", "task/2", 2, 20);
  EXPECT_EQ(disk.rt.stats().disk.read_bytes, both_resident.read_bytes);
  EXPECT_EQ(host.state(), disk.state());
}

// `count` f32 task units, "task/0" on, of task_elements each.
std::vector<unit_spec> f32_tasks(int count)
{
  std::vector<unit_spec> u;
  for (int t = 0; t < count; ++t) {
    u.push_back({.name = "task/" + std::to_string(t), .tensors = {{"w", {task_elements}}}, .compute = dtype::f32});
  }
  return u;
}

// A pinned trunk and eight f32 tasks with device AdamW, prefetched a step ahead in a budget of
// two tasks, trained in `schedule`'s order three times over, the device kept up with
// (synchronised each step); with a `storage` directory, the tasks' homes are unit files behind a
// host cache of `host_cache` bytes. The disk bytes read in the steps, and every home's state.
std::pair<std::uint64_t, std::string> train_schedule(const fs::path& storage, std::size_t host_cache,
                                                     const std::vector<int>& schedule)
{
  std::vector<unit_spec> u = f32_tasks(8);
  u.insert(u.begin(), {.name = "trunk", .tensors = {{"w", {64, 64}}}, .compute = dtype::f32});
  u.front().policy = unit_policy{residency::pinned, 0, optimizer_placement::device};
  runtime_options o;
  o.device = {.backend = backend_kind::emulated, .budget = 1000 * 1024};
  unit_rule tasks;
  tasks.match = "task/*";
  tasks.residency = residency::prefetch;
  tasks.lookahead = 1;
  if (!storage.empty()) {
    tasks.home = "disk";
    o.storage = {.path = storage, .host_cache = host_cache, .queue_depth = 4, .block = 64 * 1024};
  }
  o.units.push_back(tasks);
  const device dev = emulated_device({.memory_bytes = std::size_t{4} << 20U, .link = {}});
  const stream s(dev);
  runtime rt(dev, o, u);
  const unit_id trunk = rt.find("trunk");
  const std::size_t steps = 3 * schedule.size();
  const auto task_of = [&](std::size_t step) {
    return rt.find("task/" + std::to_string(schedule[step % schedule.size()]));
  };
  std::vector<step_plan> plans;
  for (std::size_t k = 0; k < steps; ++k) { plans.push_back(step_plan{trunk, task_of(k)}); }
  rt.plan(plans);
  for (std::size_t step = 0; step < steps; ++step) {
    train_step(rt, s, {trunk, task_of(step)}, step);
    s.synchronize();
  }
  return {rt.stats().disk.read_bytes, home_state(rt)};
}

// A home whose device copy serves its unit's next use, an update on the device, is not read
// again while that copy stays (the update supersedes it): the cache lets it go before a home
// that a later swap-in reads. Here no home is read from its file at all (before, one was, and
// other schedules read up to twice the homes), and the results are those of host homes.
TEST_F(disk_home_test, a_home_whose_device_copy_serves_its_next_use_is_let_go_first)
{
  const std::vector<int> schedule{7, 7, 2, 0, 4, 0, 5};
  const auto [host_read, host_state] = train_schedule({}, 0, schedule);
  const auto [disk_read, disk_state] = train_schedule(dir_, 1000 * 1024, schedule);  // about four homes
  EXPECT_EQ(disk_read, 0U);
  EXPECT_EQ(host_state, disk_state);
}

// The bytes one home's block takes in the host cache under `o` (a runtime that touches the
// first unit's home once); the storage directory is removed after.
std::size_t one_home_block(const runtime_options& o, const std::vector<unit_spec>& u, const fs::path& dir)
{
  std::size_t block = 0;
  {
    const device dev = emulated_device({.memory_bytes = std::size_t{4} << 20U, .link = {}});
    runtime probe(dev, o, u);
    (void)probe.home(unit_id{0});
    block = probe.stats().disk.cached_bytes;
  }
  fs::remove_all(dir);
  return block;
}

// A home read for a swap-in stays in the cache while the device makes the unit's room: the
// write-backs of the device's victims take the blocks of other homes, not its own (before, the
// acquire had taken the unit's use from the plan, its block looked never used again, and a
// victim's write-back let it go, to be read back at once while the trainer waited). Three blocks
// of cache: a unit read ahead beside two homes no step uses, and the device full of two updated
// units, one of which must go home to make the unit's room.
TEST_F(disk_home_test, a_home_read_for_a_swap_in_stays_while_the_device_makes_its_room)
{
  const std::vector<unit_spec> u = f32_tasks(5);
  runtime_options o;
  o.device = {.backend = backend_kind::emulated, .budget = 800 * 1024};  // two units, not three
  unit_rule tasks;
  tasks.match = "task/*";
  tasks.residency = residency::on_demand;
  tasks.home = "disk";
  o.units.push_back(tasks);
  o.storage = {.path = dir_, .host_cache = std::size_t{1} << 20U, .queue_depth = 4, .block = 64 * 1024, .lookahead = 0};
  const device dev = emulated_device({.memory_bytes = std::size_t{4} << 20U, .link = {}});
  const stream s(dev);
  const std::size_t block = one_home_block(o, u, dir_);
  ASSERT_GT(block, 0U);
  o.storage.host_cache = 3 * block + block / 2;  // three homes
  runtime rt(dev, o, u);
  const unit_id v = rt.find("task/0");
  const unit_id w = rt.find("task/1");
  const unit_id c = rt.find("task/2");
  const std::vector<step_plan> plans{step_plan{v}, step_plan{w}, step_plan{c}};
  rt.plan(plans);
  for (const unit_id t : {v, w}) {  // the device holds both, updated; the end of w's step reads c ahead
    train_step(rt, s, {t}, 0);
    s.synchronize();
  }
  (void)rt.home(rt.find("task/3"));  // two homes no step uses take the blocks of v and w
  (void)rt.home(rt.find("task/4"));
  train_step(rt, s, {c}, 2);
  s.synchronize();
  EXPECT_EQ(rt.stats().disk.read_bytes, 0U) << "the home of task/2 was let go and read again";
}

// After a failure the runtime refuses to hand out a home that is older than its unit's newest
// update: v and w are updated on the device, and the cache let their dirty blocks go unwritten
// (superseded: the write-back would bring them whole), so their files hold the initial values.
// A failed copy then loses the device copies. A home not behind stays readable as it was.
TEST_F(disk_home_test, after_a_failure_a_home_older_than_its_device_copy_is_refused_and_the_others_read)
{
  const std::vector<unit_spec> u = f32_tasks(5);
  runtime_options o;
  o.device = {.backend = backend_kind::emulated, .budget = 1200 * 1024};  // three units: no device eviction
  unit_rule tasks;
  tasks.match = "task/*";
  tasks.residency = residency::on_demand;
  tasks.home = "disk";
  o.units.push_back(tasks);
  o.storage = {.path = dir_, .host_cache = std::size_t{1} << 20U, .queue_depth = 4, .block = 64 * 1024, .lookahead = 0};
  const std::size_t block = one_home_block(o, u, dir_);
  ASSERT_GT(block, 0U);
  o.storage.host_cache = 3 * block + block / 2;  // three homes
  // Copies 1 and 2 bring v and w in; the third, c's swap-in, fails.
  const device dev = emulated_device({.memory_bytes = std::size_t{4} << 20U, .link = {}}, {.fail_copy = 3});
  const stream s(dev);
  runtime rt(dev, o, u);
  const unit_id v = rt.find("task/0");
  const unit_id w = rt.find("task/1");
  const unit_id c = rt.find("task/2");
  const unit_id idle = rt.find("task/3");
  for (const unit_id t : {v, w}) {  // initial values: dirty blocks
    const home_view h = rt.home(t);
    std::fill_n(static_cast<float*>(h.master.data), h.master.count, 0.25F);
  }
  rt.plan(std::vector<step_plan>{step_plan{v}, step_plan{w}, step_plan{c}});
  for (const unit_id t : {v, w}) {
    train_step(rt, s, {t}, 0);
    s.synchronize();
  }
  {
    const home_view h = rt.home(idle);
    std::fill_n(static_cast<float*>(h.master.data), h.master.count, 0.5F);
  }
  (void)rt.home(rt.find("task/4"));  // takes v's block, and c's block takes w's
  expect_error_mentioning<device_error>(  // from whichever call meets the failed copy first
    [&] {
      (void)rt.acquire(c, s);
      rt.release(c, s);
      (void)rt.end_step();
      rt.flush();
    },
    "copy 3");
  for (const unit_id t : {v, w}) {
    SCOPED_TRACE(rt.name(t));
    expect_error_mentioning<storage_error>([&] { (void)rt.home(t); },
                                           "is older than its last write-back: its newest bytes were in the device "
                                           "copy, which the failure lost; resume from the last checkpoint");
  }
  const home_view h = rt.home(idle);
  const auto* m = static_cast<const float*>(h.master.data);
  EXPECT_TRUE(std::all_of(m, m + h.master.count, [](float x) { return x == 0.5F; }));
}

// The warnings logged while it lives.
class captured_warnings {
 public:
  captured_warnings()
      : previous_(set_log_handler([this](log_level level, std::string_view text) {
          if (level == log_level::warning) { text_.emplace_back(text); }
        }))
  {}
  ~captured_warnings() { set_log_handler(previous_); }
  captured_warnings(const captured_warnings&) = delete;
  captured_warnings& operator=(const captured_warnings&) = delete;
  [[nodiscard]] const std::vector<std::string>& text() const noexcept { return text_; }

 private:
  std::vector<std::string> text_;
  log_handler previous_;
};

// A step whose disk homes do not fit the host cache together still trains, bitwise as with host
// homes, under both optimizer placements: the cache reads a home again within the step where it
// must. Here a cache of one home, and steps of three. With its AdamW on the host a unit keeps
// its home in use from its acquire to its update and release, so three held to the step's end do
// not fit: the plan says so once, as a warning naming the step and what to raise [storage]
// host_cache to. Planned with each released before the next is acquired, as the trainer does,
// they do fit. With AdamW on the device a home is in use only while it is read: nothing to say.
TEST_F(disk_home_test, a_step_whose_homes_do_not_fit_the_cache_together_trains_bitwise_and_the_plan_says_so)
{
  const std::vector<unit_spec> u = f32_tasks(4);
  const auto of_step = [](std::uint32_t k, std::uint32_t i) { return unit_id{k == 0 ? 0 : (k + i) % 4}; };
  for (const optimizer_placement placement : {optimizer_placement::device, optimizer_placement::host}) {
    for (const bool released : {false, true}) {
      SCOPED_TRACE(std::string(placement == optimizer_placement::host ? "host AdamW" : "device AdamW") +
                   (released ? ", each released in the plan" : ", held to the step's end in the plan"));
      std::size_t block = 0;
      const auto run = [&](const fs::path& storage, std::vector<std::string>& warnings) {
        runtime_options o;
        o.device = {.backend = backend_kind::emulated, .budget = std::size_t{4} << 20U};
        unit_rule tasks;
        tasks.match = "task/*";
        tasks.residency = residency::on_demand;
        tasks.optimizer = placement;
        if (!storage.empty()) {
          tasks.home = "disk";
          o.storage = {.path = storage, .host_cache = 320 * 1024, .queue_depth = 4, .block = 64 * 1024};
        }
        o.units.push_back(tasks);
        const device dev = emulated_device({.memory_bytes = std::size_t{16} << 20U, .link = {}});
        const stream s(dev);
        runtime rt(dev, o, u);
        std::vector<step_plan> plans;
        for (std::uint32_t k = 0; k < 4; ++k) {
          step_plan p;
          for (std::uint32_t i = 0; i < (k == 0 ? 1U : 3U); ++i) {
            p.acquire(of_step(k, i));
            if (released) { p.release(of_step(k, i)); }
          }
          plans.push_back(p);
        }
        {
          const captured_warnings logged;
          rt.plan(plans);
          warnings = logged.text();
        }
        train_step(rt, s, {of_step(0, 0)}, 0);
        for (std::uint32_t k = 1; k < 4; ++k) { train_step(rt, s, {of_step(k, 0), of_step(k, 1), of_step(k, 2)}, k); }
        s.synchronize();
        block = rt.stats().disk.cached_bytes;  // one home: the cache holds no more
        return home_state(rt);
      };
      std::vector<std::string> host_warnings;
      std::vector<std::string> disk_warnings;
      const std::string host = run({}, host_warnings);
      fs::remove_all(dir_);
      EXPECT_EQ(run(dir_, disk_warnings), host);
      EXPECT_TRUE(host_warnings.empty());
      if (placement == optimizer_placement::device || released) {
        EXPECT_TRUE(disk_warnings.empty()) << disk_warnings.front();
        continue;
      }
      ASSERT_EQ(disk_warnings.size(), 1U);
      const std::string& w = disk_warnings[0];
      const std::string three = detail::bytes_text(3 * block);
      EXPECT_NE(w.find("plan step 1 keeps " + three), std::string::npos) << w;
      EXPECT_NE(w.find("(3 units whose AdamW runs on the host"), std::string::npos) << w;
      EXPECT_NE(w.find("more than the 320.0 KiB"), std::string::npos) << w;
      EXPECT_NE(w.find("Raise [storage] host_cache to at least " + three), std::string::npos) << w;
    }
  }
}

}  // namespace
}  // namespace taskswap::test
