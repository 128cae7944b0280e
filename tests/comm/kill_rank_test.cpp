// SPDX-License-Identifier: Apache-2.0
// A rank dies in the middle of a run (SIGKILL, as the OOM killer or a node failure would); every
// other rank must end with taskswap's timeout_error or comm_error within the communicator's
// timeout instead of hanging. Run by run_kill_rank.sh under mpirun --enable-recovery (so that
// mpirun lets the survivors finish); each survivor prints KILL-TEST-PASS or KILL-TEST-FAIL.

#include <taskswap/taskswap.hpp>

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string_view>

int main(int argc, char** argv)
{
  using namespace taskswap;
  using clock = std::chrono::steady_clock;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  constexpr std::chrono::milliseconds timeout{3000};
  constexpr int victim_step = 5;
  // Where the victim dies: before the step's plan (the others wait in the agreement) or in
  // backward after it (the others wait in a gradient bucket).
  const bool in_backward = argc > 1 && std::string_view(argv[1]) == "in-backward";

  runtime_options opt;
  opt.device.backend = backend_kind::emulated;
  opt.device.budget = std::size_t{4} << 20;
  opt.comm.backend = comm_backend::mpi;
  opt.comm.timeout = timeout;
  std::vector<unit_spec> units;
  for (const char* name : {"trunk", "head0", "head1"}) {
    units.push_back(unit_spec{.name = name, .tensors = {{"w", {128, 64}}}, .compute = dtype::f32, .grad = {}, .policy = {}});
  }
  auto last_progress = clock::now();
  try {
    const device dev = make_device(opt.device);
    runtime rt(dev, opt, units);
    stream compute(dev);
    for (int k = 0; k < 200; ++k) {
      const bool victim = rank == size - 1 && k == victim_step;
      if (victim && !in_backward) { kill(getpid(), SIGKILL); }
      const unit_id head{static_cast<std::uint32_t>(1 + (k + rank) % 2)};
      rt.plan(step_plan{unit_id{0}, head});
      if (victim) { kill(getpid(), SIGKILL); }
      for (const unit_id u : {head, unit_id{0}}) {
        (void)rt.acquire(u, compute);
        rt.grads_ready(u, compute);
        rt.step(u, compute);
        rt.release(u, compute);
      }
      (void)rt.end_step();
      last_progress = clock::now();
    }
    rt.flush();
    std::printf("rank %d: KILL-TEST-FAIL: 200 steps finished although rank %d died\n", rank, size - 1);
  } catch (const taskswap::error& e) {
    const double waited = std::chrono::duration<double>(clock::now() - last_progress).count();
    const bool in_time = waited < std::chrono::duration<double>(timeout).count() + 10.0;
    const bool expected = dynamic_cast<const timeout_error*>(&e) != nullptr || dynamic_cast<const comm_error*>(&e) != nullptr;
    std::printf("rank %d: %s: ended %.1f s after its last step with: %s\n", rank,
                in_time && expected ? "KILL-TEST-PASS" : "KILL-TEST-FAIL", waited, e.what());
  }
  std::fflush(stdout);
  std::_Exit(0);  // MPI cannot be finalised with a dead peer; the job ends here
}
