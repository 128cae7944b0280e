// SPDX-License-Identifier: Apache-2.0
// The `taskswap` command line:
//   taskswap plan CONFIG       predicted device and host bytes, traffic, transfer time, largest batch
//   taskswap probe             devices, NUMA nodes, copy rates, copy engines; a drive's unit-file rates
//   taskswap headroom CONFIG   the largest batch all-resident and with taskswap, measured

#include "commands.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

// NOLINTNEXTLINE(bugprone-exception-escape): only setting the options up (a programming error) throws outside the try
int main(int argc, char** argv)
{
  using namespace taskswap::tools;
  CLI::App app{"taskswap: plan, probe and measure per-task state swapping"};
  app.require_subcommand(1);

  plan_args plan;
  std::optional<std::string> bytes_per_sample;
  CLI::App* p = app.add_subcommand("plan", "predict device bytes, pinned host bytes, bytes moved per step, transfer "
                                           "time and the largest batch for a configuration");
  p->add_option("config", plan.config, "configuration (runtime sections and [model]; default: the embedded sample)");
  p->add_option("--json", plan.json, "also write the report as JSON to this file ('-': standard output)");
  p->add_option("--link-rate", plan.link_rate, "host↔device rate for the transfer time, e.g. \"25 GB/s\"");
  p->add_option("--disk-read-rate", plan.disk_read_rate,
                "the [storage] drive's read rate for the disk time (taskswap probe --storage), e.g. \"3 GB/s\"");
  p->add_option("--disk-write-rate", plan.disk_write_rate, "… and its write rate, e.g. \"2 GB/s\"");
  p->add_flag("--measure-link", plan.measure_link, "measure the rate on the configured device");
  p->add_flag("--measure-disk", plan.measure_disk,
              "measure the [storage] path's drive for the disk time (a 64 MiB unit file, as probe --storage)");
  p->add_option("--device-memory", plan.device_memory,
                "device bytes the budget and activations share, e.g. \"80 GiB\"");
  p->add_option("--bytes-per-sample", bytes_per_sample, "activation bytes per sample (default: the sample model's)");
  p->add_option("--steps", plan.steps, "steps of the schedule to replay (default: [model] steps)")
    ->check(CLI::PositiveNumber);

  probe_args probe;
  CLI::App* pr = app.add_subcommand("probe", "devices, NUMA nodes, host↔device copy rates, copy engines");
  pr->add_option("--json", probe.json, "also write the results as JSON to this file ('-': standard output)");
  pr->add_option("--size", probe.size, "bytes per copy");
  pr->add_option("--repeats", probe.repeats, "copies per measurement")->check(CLI::PositiveNumber);
  pr->add_flag("--emulated", probe.emulated, "probe the emulated device even where there is a GPU");
  pr->add_option("--storage", probe.storage,
                 "also measure reading and writing unit files in this directory (the disk tier's drive)");
  pr->add_option("--storage-size", probe.storage_size, "bytes of the unit file --storage reads and writes");

  headroom_args headroom;
  bool quiet = false;
  CLI::App* h = app.add_subcommand("headroom", "measure the largest batch all-resident and with taskswap (real steps, "
                                               "out-of-memory caught), beside the planner's prediction");
  h->add_option("config", headroom.config,
                "configuration (runtime sections and [model]; default: the embedded sample)");
  h->add_option("--json", headroom.json, "also write the results as JSON to this file ('-': standard output)");
  h->add_option("--trace", headroom.trace, "write a Perfetto trace of the taskswap run at its largest batch");
  h->add_option("--device-memory", headroom.device_memory, "cap the device bytes used (cuda), e.g. \"16 GiB\"");
  h->add_option("--probe-steps", headroom.probe_steps, "steps per probe of a batch size")->check(CLI::Range(1, 64));
  h->add_option("--steps", headroom.timed_steps, "steps of the timed runs")->check(CLI::Range(2, 64));
  h->add_option("--rounds", headroom.rounds, "timed runs per arm, alternating; the fastest counts")
    ->check(CLI::Range(1, 20));
  h->add_flag("--quiet", quiet, "no progress line");

  CLI11_PARSE(app, argc, argv);
  try {
    if (p->parsed()) {
      if (bytes_per_sample) { plan.bytes_per_sample = taskswap::parse_size(*bytes_per_sample); }
      return run_plan(plan);
    }
    if (pr->parsed()) { return run_probe(probe); }
    headroom.progress = !quiet;
    return run_headroom(headroom);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "taskswap: %s\n", e.what());
    return 1;
  }
}
