// SPDX-License-Identifier: Apache-2.0
// A rank dies in the middle of a run (SIGKILL, as the OOM killer or a node failure would); every
// other rank must end with taskswap's timeout_error or comm_error within the communicator's
// timeout instead of hanging, and with every unit's home copy a state the fault-free run passes
// through (no update from gradients that never arrived was written home). Run by
// run_kill_rank.sh under mpirun --enable-recovery (so that mpirun lets the survivors finish);
// each survivor prints KILL-TEST-PASS or KILL-TEST-FAIL.

#include "storage/crc32c.hpp"

#include <taskswap/taskswap.hpp>

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

namespace {

using namespace taskswap;

// Every rank writes this gradient: a power of two, so its average over 1, 2 or 4 contributors is
// exactly itself, and the reduced update is bitwise the update of a single process.
constexpr float gradient = 0.0078125F;

void initialise(runtime& rt)
{
  for (std::size_t i = 0; i < rt.unit_count(); ++i) {
    const home_view h = rt.home({static_cast<std::uint32_t>(i)});
    auto* m = static_cast<float*>(h.master.data);
    for (std::size_t k = 0; k < h.master.count; ++k) { m[k] = 0.01F * static_cast<float>((k + 3 * i) % 37) - 0.15F; }
  }
}

void fill_gradient(const unit_view& v, stream_view s)
{
  auto* g = static_cast<float*>(v.grads.data);
  const std::size_t n = v.grads.count;
  launch_host_func(s, [g, n] { std::fill(g, g + n, gradient); });
}

std::uint32_t home_sum(runtime& rt, unit_id u)
{
  const home_view h = rt.home(u);
  std::uint32_t c = 0;
  for (const slab_view& v : {h.params, h.m, h.v}) {
    c = detail::crc32c(std::span(static_cast<const std::byte*>(v.data), v.bytes()), c);
  }
  return c;
}

// Each unit's home states after 0, 1, … updates with that gradient, in one process.
std::vector<std::set<std::uint32_t>> reference(runtime_options opt, const std::vector<unit_spec>& units, int updates)
{
  opt.comm.backend = comm_backend::none;
  opt.device.budget = std::size_t{4} << 20;
  const device dev = make_device(opt.device);
  runtime rt(dev, opt, units);
  initialise(rt);
  stream s(dev);
  std::vector<std::set<std::uint32_t>> out(units.size());
  for (std::uint32_t u = 0; u < units.size(); ++u) { out[u].insert(home_sum(rt, {u})); }
  for (int k = 0; k < updates; ++k) {
    for (std::uint32_t u = 0; u < units.size(); ++u) {
      rt.plan(step_plan{unit_id{u}});
      fill_gradient(rt.acquire({u}, s), s);
      rt.grads_ready({u}, s);
      rt.step({u}, s);
      rt.release({u}, s);
      (void)rt.end_step();
    }
    rt.flush();
    for (std::uint32_t u = 0; u < units.size(); ++u) { out[u].insert(home_sum(rt, {u})); }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv)
{
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
  opt.optimizer.lr = 1e-2;
  opt.comm.backend = comm_backend::mpi;
  opt.comm.timeout = timeout;
  std::vector<unit_spec> units;
  for (const char* name : {"trunk", "head0", "head1", "head2", "head3"}) {
    units.push_back(
      unit_spec{.name = name, .tensors = {{"w", {128, 64}}}, .compute = dtype::f32, .grad = {}, .policy = {}});
  }
  // Each step holds the trunk and two heads (every rank holds the heads others train, for their
  // update): room for three units, so heads come and go and are written back.
  opt.device.budget = 3 * footprint(units[0], optimizer_placement::device).device_bytes;
  opt.device.emulated.memory_bytes = std::size_t{4} << 20;
  auto last_progress = clock::now();
  std::optional<device> dev;
  std::optional<runtime> rt_slot;
  try {
    dev.emplace(make_device(opt.device));
    runtime& rt = rt_slot.emplace(*dev, opt, units);
    initialise(rt);
    stream compute(*dev);
    for (int k = 0; k < 200; ++k) {
      const bool victim = rank == size - 1 && k == victim_step;
      if (victim && !in_backward) { kill(getpid(), SIGKILL); }
      const unit_id head{static_cast<std::uint32_t>(1 + (k + rank % 2) % 4)};
      rt.plan(step_plan{unit_id{0}, head});
      if (victim) { kill(getpid(), SIGKILL); }
      for (const unit_id u : {head, unit_id{0}}) {
        fill_gradient(rt.acquire(u, compute), compute);
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
    const bool expected =
      dynamic_cast<const timeout_error*>(&e) != nullptr || dynamic_cast<const comm_error*>(&e) != nullptr;
    // Once the device's queue has drained, every home copy must be a state of the fault-free run.
    bool intact = rt_slot.has_value();
    if (rt_slot) {
      try {
        dev->synchronize();
      } catch (const taskswap::error&) {  // the failure again, once the abandoned work is skipped
      }
      const auto states = reference(opt, units, 200);
      for (std::uint32_t u = 0; u < units.size(); ++u) {
        if (!states[u].contains(home_sum(*rt_slot, {u}))) {
          std::printf("rank %d: unit '%s': its home copy is no state of the fault-free run\n", rank,
                      units[u].name.c_str());
          intact = false;
        }
      }
    }
    std::printf("rank %d: %s: ended %.1f s after its last step with: %s%s\n", rank,
                in_time && expected && intact ? "KILL-TEST-PASS" : "KILL-TEST-FAIL", waited, e.what(),
                intact ? " (home copies intact)" : " (home copies NOT intact)");
  }
  std::fflush(stdout);
  std::_Exit(0);  // MPI cannot be finalised with a dead peer; the job ends here
}
