// SPDX-License-Identifier: Apache-2.0
// multitask_train: trains the sample multi-task model from a configuration (runtime sections plus
// [model]) on one process, or on every rank under mpirun when [comm] names a backend. Prints
// per-task losses as it goes and a summary at the end.
//
//   multitask_train samples/configs/emulated.toml
//   multitask_train samples/configs/emulated.toml --all-resident --save-params resident.bin
//   mpirun -np 2 multitask_train samples/configs/emulated-mpi.toml

#include "model.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

namespace {

std::string mib(std::size_t bytes) { return std::to_string(bytes >> 20U) + " MiB"; }

// This run's command line with `--resume DIR` in place of any earlier --resume: the same flags
// (--checkpoint, --steps, …), so a resumed run that is preempted again saves again.
std::string resume_command(int argc, char** argv, const std::string& dir)
{
  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--resume") {
      ++i;  // and its value
      continue;
    }
    if (a.starts_with("--resume=")) { continue; }
    command += ' ';
    command += a;
  }
  return command + " --resume " + dir;
}

// The run's summary: traffic, the disk homes', the guarded steps', each task's first and last losses.
void print_summary(const multitask::run_result& r, std::size_t budget)
{
  std::printf("summary: %.2f ms/step; swap-ins %zu, write-backs %zu, h2d %s, d2h %s, stall %.1f ms; reduced %s; "
              "device peak %zu bytes of a %zu-byte budget\n",
              r.step_ms(), r.total.swap_ins, r.total.write_backs, mib(r.total.h2d_bytes).c_str(),
              mib(r.total.d2h_bytes).c_str(), r.total.stall_ms, mib(r.total.reduced_bytes).c_str(),
              r.total.peak_device_bytes, budget);
  if (r.disk.host_cache_bytes != 0) {
    std::printf("  disk homes: %s read (%llu reads started ahead), %llu writes (%s) through a %s host cache (%llu "
                "hits, %llu misses); waited for the drive %.1f ms\n",
                mib(r.disk.read_bytes).c_str(), static_cast<unsigned long long>(r.disk.prefetches),
                static_cast<unsigned long long>(r.disk.written_back), mib(r.disk.written_bytes).c_str(),
                mib(r.disk.host_cache_bytes).c_str(), static_cast<unsigned long long>(r.disk.hits),
                static_cast<unsigned long long>(r.disk.misses), r.disk.wait_ms);
    const double done = static_cast<double>(std::max<std::int64_t>(1, r.steps_done - r.first_step));
    std::printf("  disk per step: %.1f KiB read, %.1f KiB written (the steps alone; taskswap plan predicts them)\n",
                static_cast<double>(r.disk_read_in_steps) / 1024.0 / done,
                static_cast<double>(r.disk_written_in_steps) / 1024.0 / done);
  }
  if (r.scaler) {
    std::printf("  guarded steps: loss scale %g, %lld of %lld steps skipped (a gradient not finite), last global "
                "gradient norm %.4g\n",
                static_cast<double>(r.scaler->scale), static_cast<long long>(r.scaler->skipped_steps),
                static_cast<long long>(r.scaler->steps), static_cast<double>(r.scaler->last_norm));
  }
  if (r.timed_steps > 0) {
    const double us = r.stop_agreement_seconds * 1e6 / static_cast<double>(r.timed_steps);
    std::printf("  stop agreement: %.1f us/step (%.2f%% of a step)\n", us, us / (r.step_ms() * 10.0));
  }
  std::printf("  %-8s %6s %10s %10s   (mean loss of each task's first and last 3 steps)\n", "task", "steps", "first",
              "last");
  int fell = 0;
  int trained = 0;
  for (std::size_t i = 0; i < r.tasks.size(); ++i) {
    const multitask::task_losses& l = r.tasks[i];
    if (l.steps == 0) { continue; }
    ++trained;
    if (l.last < l.first) { ++fell; }
    if (trained <= 12) {
      std::printf("  task/%-3zu %6lld %10.4f %10.4f\n", i, static_cast<long long>(l.steps), l.first, l.last);
    }
  }
  if (trained > 12) { std::printf("  (%d more tasks)\n", trained - 12); }
  std::printf("loss fell on %d of %d tasks trained on rank 0\n", fell, trained);
}

int train(int argc, char** argv)
{
  CLI::App app{"Trains the taskswap sample multi-task model"};
  std::string config_file;
  bool resident = false;
  std::string save;
  int steps = 0;
  int batch = 0;
  int freeze_trunk_after = -1;
  int tasks_per_step = 0;
  int log_every = -1;
  app.add_option("config", config_file, "configuration (TOML: runtime sections and [model])")->required();
  app.add_flag("--all-resident", resident, "every unit pinned on the device, budget = their bytes (the baseline)");
  app.add_option("--steps", steps, "override [model] steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "override [model] batch")->check(CLI::PositiveNumber);
  app
    .add_option("--tasks-per-step", tasks_per_step,
                "override [model] tasks_per_step: tasks trained in each step, the batch's rows split among them")
    ->check(CLI::PositiveNumber);
  app
    .add_option("--freeze-trunk-after", freeze_trunk_after,
                "override [model] freeze_trunk_after: from this step on the trunk is used frozen and only the task "
                "adapters train (0: never)")
    ->check(CLI::NonNegativeNumber);
  app.add_option("--log-every", log_every, "override [model] log_every: steps between loss lines (0: none)")
    ->check(CLI::NonNegativeNumber);
  std::string activations;
  app
    .add_option("--activations", activations,
                "override [activations] offload: \"host\" keeps the trunk's activations in the runtime's activation "
                "blocks, stashed after each layer's forward and brought back for its backward; \"none\" (the "
                "default) in the trainer's workspace. --all-resident never offloads")
    ->check(CLI::IsMember({"host", "none"}));
  std::string checkpoint;
  std::string resume;
  int checkpoint_every = 0;
  std::int64_t stop_after = -1;
  app.add_option("--checkpoint", checkpoint,
                 "save a checkpoint to this directory at the end (and every --checkpoint-every steps)");
  app.add_option("--checkpoint-every", checkpoint_every, "steps between checkpoints")->check(CLI::PositiveNumber);
  app.add_option("--resume", resume, "continue from the checkpoint in this directory");
  app.add_option("--stop-after", stop_after, "end after this many steps in all, as an interrupted run would")
    ->check(CLI::NonNegativeNumber);
  app.add_option("--save-params", save,
                 "write every unit's final home slabs (params, master, m, v) to this file (FILE.rankN under mpirun)");
  bool no_stop = false;
  app.add_flag(
    "--no-stop-agreement", no_stop,
    "no signal handlers and no agreement on stopping (the default dies on SIGTERM; to measure the agreement's cost)");
  CLI11_PARSE(app, argc, argv);

  multitask::configuration cfg = multitask::load_configuration(config_file);
  if (steps > 0) { cfg.model.steps = steps; }
  if (batch > 0) { cfg.model.batch = batch; }
  if (freeze_trunk_after >= 0) { cfg.model.freeze_trunk_after = freeze_trunk_after; }
  if (tasks_per_step > 0) { cfg.model.tasks_per_step = tasks_per_step; }
  if (log_every >= 0) { cfg.model.log_every = log_every; }
  if (!activations.empty()) { cfg.model.offload_activations = activations == "host"; }
  if (resident) { cfg.model.offload_activations = false; }  // the baseline: nothing moves
  const auto units = multitask::model_units(cfg.model);
  taskswap::runtime_options options = resident ? multitask::all_resident(cfg.runtime, units) : cfg.runtime;
  if (options.device.backend == taskswap::backend_kind::emulated) {
    // An emulated device at least as large as the budget and the trainer's workspace (the
    // all-resident budget may exceed the configured memory: the baseline still trains).
    const std::size_t needed =
      options.device.budget +
      multitask::model_workspace(cfg.model, cfg.model.steps).bytes(static_cast<std::size_t>(cfg.model.batch));
    options.device.emulated.memory_bytes = std::max(options.device.emulated.memory_bytes, needed);
  }
  const taskswap::device dev = taskswap::make_device(options.device);
  multitask::trainer t(dev, options, cfg.model, cfg.model.batch, cfg.model.steps);
  const bool lead = t.rank() == 0;
  if (lead) {
    std::printf("multitask_train: %d tasks, %d trunk layers, width %d, adapters %d→%d→%d, %s, batch %d, %d steps, "
                "%d rank(s)\n",
                cfg.model.tasks, cfg.model.trunk_layers, cfg.model.width, cfg.model.width, cfg.model.adapter_hidden,
                cfg.model.outputs, std::string(taskswap::to_string(cfg.model.compute)).c_str(), cfg.model.batch,
                cfg.model.steps, t.world());
    std::printf("device %s, budget %s%s\n", dev.name().c_str(), mib(options.device.budget).c_str(),
                resident ? " (all resident)" : "");
  }
  if (!resume.empty()) {
    const std::int64_t at = t.resume(resume);
    if (lead) { std::printf("resumed from '%s' at step %lld\n", resume.c_str(), static_cast<long long>(at)); }
  }
  // The first SIGTERM, SIGINT or SIGUSR1 stops every rank at the same step boundary; a second one
  // ends the process at once.
  std::optional<taskswap::stop_signals> signals;
  if (!no_stop) { signals.emplace(); }
  multitask::run_options run{.on_log =
                               [&](const std::string& line) {
                                 if (lead) { std::printf("  %s\n", line.c_str()); }
                               },
                             .checkpoint = checkpoint,
                             .checkpoint_every = checkpoint_every,
                             .stop_after = stop_after,
                             .stop_code = {}};
  if (signals) {
    run.stop_code = [&] { return signals->signal(); };
  }
  const multitask::run_result r = t.run(run);
  if (lead && !checkpoint.empty()) { std::printf("checkpoint saved to '%s'\n", checkpoint.c_str()); }
  if (r.stopped_by != 0) {
    // Preempted: every rank finished the same step; with --checkpoint the state is saved.
    if (lead) {
      std::printf("stopped at step %lld of %d on signal %d (%s)\n", static_cast<long long>(r.steps_done),
                  cfg.model.steps, r.stopped_by, strsignal(r.stopped_by));
      if (!checkpoint.empty()) {
        std::printf("resume with: %s\n", resume_command(argc, argv, checkpoint).c_str());
      } else {
        std::printf("nothing was saved (no --checkpoint): the %lld steps done are lost\n",
                    static_cast<long long>(r.steps_done));
      }
    }
    std::fflush(stdout);
    if (checkpoint.empty()) { return taskswap::stop_signals::exit_code(r.stopped_by); }
    return 0;
  }
  if (!save.empty()) { t.save_parameters(t.world() > 1 ? save + ".rank" + std::to_string(t.rank()) : save); }
  if (lead) { print_summary(r, options.device.budget); }
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach a log file (a cluster job's) as they come
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "multitask_train: %s\n", e.what());
    return 1;
  }
}
