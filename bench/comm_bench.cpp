// SPDX-License-Identifier: Apache-2.0
// comm_reducer: the active-gradient reducer against reducing every unit (what DDP does), in the
// same run. Run under MPI: mpirun -np 2 build/<preset>/bench/taskswap_comm_bench (make bench does).
//
// The model is a trunk and 16 task heads, all resident; in each step every rank trains the trunk
// and the same one head (one task per step). The same training loop runs twice: with the reducer
// (the trunk's and one head's gradients travel) and with [comm] reduce = "every_unit" (every
// unit's gradients travel and every unit is updated, zeros included: DDP's bytes). Counters, per step:
//   bytes_active, bytes_all   gradient bytes allreduced
//   bytes_ratio               bytes_active / bytes_all (expected: active units' bytes / all units' bytes)
//   ms_active, ms_all         wall time per step, the loop ending with a flush
//   time_ratio                ms_active / ms_all
// On the emulated device this measures MPI over shared memory and the CPU AdamW stand-in; on a
// GPU machine the same loop uses NCCL (world size 1 there: bytes, not bandwidth, are the point).

#include <taskswap/comm.hpp>
#include <taskswap/taskswap.hpp>

#include <benchmark/benchmark.h>
#include <mpi.h>

#include <chrono>
#include <string>
#include <vector>

namespace {

using namespace taskswap;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t heads = 16;

std::vector<unit_spec> model(std::size_t trunk_elements, std::size_t head_elements)
{
  std::vector<unit_spec> units;
  const auto add = [&](std::string name, std::size_t n) {
    unit_spec u;
    u.name = std::move(name);
    u.tensors = {{"w", {n}}};
    u.policy = unit_policy{residency::pinned, 0, optimizer_placement::device};
    units.push_back(std::move(u));
  };
  add("trunk", trunk_elements);
  for (std::uint32_t h = 0; h < heads; ++h) { add("head" + std::to_string(h), head_elements); }
  return units;
}

struct loop_result {
  double ms_per_step = 0;
  double bytes_per_step = 0;
};

loop_result train(bool every_unit, std::size_t trunk_elements, std::size_t head_elements, int steps)
{
  runtime_options o;
  const bool gpu = cuda_device_count() > 0;
  o.device.backend = gpu ? backend_kind::cuda : backend_kind::emulated;
  o.device.budget = (trunk_elements + heads * head_elements) * 4 * sizeof(float) + (std::size_t{1} << 20);
  o.comm.backend = gpu ? comm_backend::nccl : comm_backend::mpi;
  o.comm.reduce_every_unit = every_unit;
  o.comm.timeout = std::chrono::milliseconds(120'000);
  const device dev = make_device(o.device);
  runtime rt(dev, o, model(trunk_elements, head_elements));
  stream compute(dev);
  std::vector<step_plan> plans;
  for (int k = 0; k < steps + 1; ++k) {
    plans.push_back(step_plan{unit_id{0}, unit_id{1 + static_cast<std::uint32_t>(k) % heads}});
  }
  rt.plan(plans);
  const auto one_step = [&](int k) {
    const unit_id head{1 + static_cast<std::uint32_t>(k) % heads};
    for (const unit_id u : {unit_id{0}, head}) { (void)rt.acquire(u, compute); }
    for (const unit_id u : {head, unit_id{0}}) {
      rt.grads_ready(u, compute);
      rt.step(u, compute);
      rt.release(u, compute);
    }
    (void)rt.end_step();
  };
  one_step(0);  // warm-up: first touches of memory
  rt.flush();
  MPI_Barrier(MPI_COMM_WORLD);
  const auto begin = clock_type::now();
  for (int k = 1; k <= steps; ++k) { one_step(k); }
  rt.flush();
  const double seconds = std::chrono::duration<double>(clock_type::now() - begin).count();
  const runtime_stats s = rt.stats();
  const step_stats& last = s.steps.back();
  return {seconds * 1e3 / steps, static_cast<double>(last.reduced_bytes)};
}

void comm_reducer(benchmark::State& state)
{
  const auto trunk = static_cast<std::size_t>(state.range(0));
  const auto head = static_cast<std::size_t>(state.range(1));
  constexpr int steps = 20;
  loop_result active;
  loop_result all;
  for (auto _ : state) {
    active = train(false, trunk, head, steps);
    all = train(true, trunk, head, steps);
  }
  state.counters["bytes_active"] = active.bytes_per_step;
  state.counters["bytes_all"] = all.bytes_per_step;
  state.counters["bytes_ratio"] = active.bytes_per_step / all.bytes_per_step;
  state.counters["expected_ratio"] = static_cast<double>(trunk + head) / static_cast<double>(trunk + heads * head);
  state.counters["ms_active"] = active.ms_per_step;
  state.counters["ms_all"] = all.ms_per_step;
  state.counters["time_ratio"] = active.ms_per_step / all.ms_per_step;
}
// Every rank must run the same number of iterations (each one is collective): fixed, not timed.
BENCHMARK(comm_reducer)
  ->Args({1 << 20, 1 << 18})
  ->Args({1 << 18, 1 << 18})
  ->Iterations(1)
  ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv)
{
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  benchmark::Initialize(&argc, argv);
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    benchmark::BenchmarkReporter* quiet = nullptr;
    struct null_reporter : benchmark::BenchmarkReporter {
      bool ReportContext(const Context&) override { return true; }
      void ReportRuns(const std::vector<Run>&) override {}
    } reporter;
    quiet = &reporter;
    benchmark::RunSpecifiedBenchmarks(quiet);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
