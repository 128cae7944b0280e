// SPDX-License-Identifier: Apache-2.0
// Checkpoints across ranks (run under mpirun at 3 ranks): a save that works; a save refused on
// every rank when one rank's replica differs, leaving the checkpoint there as it was; a save rank 0
// cannot write, reported on every rank; a load one rank cannot do, refused on every rank with
// nothing loaded anywhere. Every failure ends in an error on every rank, none in a hang.

#include "expect_error.hpp"
#include "mpi_test.hpp"

#include <taskswap/taskswap.hpp>

#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>

namespace taskswap::test {
namespace {

namespace fs = std::filesystem;

// One directory for the whole job: rank 0's pid, shared.
fs::path job_dir()
{
  static const fs::path dir = [] {
    long pid = static_cast<long>(::getpid());
    MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    const fs::path p = fs::temp_directory_path() / ("taskswap-checkpoint-mpi-" + std::to_string(pid));
    if (world_rank() == 0) {
      fs::remove_all(p);
      fs::create_directories(p);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    return p;
  }();
  return dir;
}

struct ranks_model {
  device dev = emulated_device({.memory_bytes = std::size_t{8} << 20U, .link = {}});
  stream s{dev};
  runtime rt;

  static runtime_options options()
  {
    runtime_options o;
    o.device = {.backend = backend_kind::emulated, .budget = std::size_t{4} << 20U};
    o.comm.backend = comm_backend::mpi;
    o.comm.timeout = std::chrono::milliseconds{20'000};
    return o;
  }
  static std::vector<unit_spec> units()
  {
    std::vector<unit_spec> u;
    for (const char* name : {"trunk", "head0", "head1"}) {
      u.push_back({.name = name, .tensors = {{"w", {1024}}}, .compute = dtype::f32});
    }
    return u;
  }
  ranks_model() : rt(dev, options(), units())
  {
    for (std::uint32_t i = 0; i < rt.unit_count(); ++i) {
      auto* m = static_cast<float*>(rt.home({i}).master.data);
      for (std::size_t k = 0; k < 1024; ++k) { m[k] = 0.001F * static_cast<float>(k % 17 + i); }
    }
  }
  void train(int steps)
  {
    for (int k = 0; k < steps; ++k) {
      const unit_id head{static_cast<std::uint32_t>(1 + (k + world_rank()) % 2)};
      rt.plan(step_plan{unit_id{0}, head});
      for (const unit_id u : {head, unit_id{0}}) {
        (void)rt.acquire(u, s);
        rt.step(u, s);
        rt.release(u, s);
      }
      (void)rt.end_step();
    }
  }
};

// Rank 0 removes the job's directory once every rank is done with it.
class remove_job_dir : public ::testing::Environment {
 public:
  void TearDown() override
  {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) { fs::remove_all(job_dir()); }
  }
};
[[maybe_unused]] ::testing::Environment* const cleanup = ::testing::AddGlobalTestEnvironment(new remove_job_dir);

TEST(checkpoint_mpi, a_save_and_a_load_on_every_rank)
{
  const fs::path dir = job_dir() / "good";
  {
    ranks_model a;
    a.train(4);
    a.rt.save_checkpoint(dir, {{"note", "four steps"}});
  }
  EXPECT_EQ(read_checkpoint_manifest(dir).world, 3);
  ranks_model b;
  EXPECT_EQ(b.rt.load_checkpoint(dir).steps_done, 4U);
  b.train(2);
}

TEST(checkpoint_mpi, a_replica_that_differs_stops_the_save_on_every_rank_and_the_old_checkpoint_stays)
{
  const fs::path dir = job_dir() / "differs";
  ranks_model a;
  a.train(3);
  a.rt.save_checkpoint(dir);
  a.train(2);
  a.rt.flush();
  if (world_rank() == 2) { static_cast<float*>(a.rt.home({1}).master.data)[7] += 1.0F; }  // this replica drifts
  expect_error_mentioning<checkpoint_error>([&] { a.rt.save_checkpoint(dir); }, "the replicas of rank(s) 2");
  EXPECT_EQ(read_checkpoint_manifest(dir).steps_done, 3U) << "the checkpoint from step 3 stays";
  verify_checkpoint(dir);
}

TEST(checkpoint_mpi, a_save_rank_0_cannot_write_is_an_error_on_every_rank)
{
  ranks_model a;
  a.train(2);
  const fs::path dir = job_dir() / "no-such-parent" / "ck";
  if (world_rank() == 0) {
    expect_error_mentioning<checkpoint_error>([&] { a.rt.save_checkpoint(dir); }, "does not exist; create it first");
  } else {
    expect_error_mentioning<checkpoint_error>([&] { a.rt.save_checkpoint(dir); },
                                              "rank 0 could not write the checkpoint");
  }
  a.train(1);  // a failed save is no failure of the runtime: training goes on
}

TEST(checkpoint_mpi, a_load_one_rank_cannot_do_is_refused_on_every_rank)
{
  const fs::path dir = job_dir() / "load";
  {
    ranks_model a;
    a.train(3);
    a.rt.save_checkpoint(dir);
  }
  ranks_model b;
  const fs::path mine = world_rank() == 1 ? job_dir() / "missing" : dir;
  if (world_rank() == 1) {
    expect_error_mentioning<checkpoint_error>([&] { (void)b.rt.load_checkpoint(mine); }, "there is no checkpoint at");
  } else {
    expect_error_mentioning<checkpoint_error>([&] { (void)b.rt.load_checkpoint(mine); },
                                              "rank(s) 1 could not load the checkpoint");
  }
  // Nothing was loaded anywhere: every rank can still load the good one, together.
  EXPECT_EQ(b.rt.load_checkpoint(dir).steps_done, 3U);
  b.train(1);
}

}  // namespace
}  // namespace taskswap::test
