// SPDX-License-Identifier: Apache-2.0
// `taskswap headroom CONFIG`: trains the sample model of a configuration at growing batch sizes,
// all-resident and under the configured policies, catching out-of-memory, to find the largest
// batch each fits (real steps, exact to one sample); then times both at the all-resident batch
// and taskswap at its own, and prints them beside the planner's prediction. Where the trunk
// streams (not pinned), it also finds the deepest trunk each trains at the configuration's batch.

#include "commands.hpp"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>

namespace taskswap::tools {
namespace {

struct arm {
  std::string name;
  runtime_options options;
  std::int64_t max_batch = 0;
  std::int64_t probes = 0;
  multitask::run_result at_max{};
};

class headroom_search {
 public:
  headroom_search(const headroom_args& args, multitask::configuration cfg, std::size_t memory)
      : args_(args), cfg_(std::move(cfg)), memory_(memory)
  {}

  // A fresh device each time (nothing left over from the last probe); on cuda, the same GPU
  // with the memory above the cap taken by a filler allocation.
  std::optional<multitask::run_result> try_batch(const runtime_options& options, std::int64_t batch, int steps,
                                                 const std::string& trace = {})
  {
    return try_model(options, cfg_.model, batch, steps, trace);
  }

  // As try_batch, for a model other than the configuration's (another trunk depth).
  // `refused_fails`: a plan the runtime refuses (its steps do not fit the budget) does not fit
  // either, where the budget is derived from the batch.
  std::optional<multitask::run_result> try_model(const runtime_options& options, multitask::model_config m,
                                                 std::int64_t batch, int steps, const std::string& trace = {},
                                                 bool refused_fails = false)
  {
    if (batch < m.tasks_per_step) {  // each task of a step takes rows of the batch
      last_oom_ = "a batch of " + std::to_string(batch) + " is below [model] tasks_per_step";
      return std::nullopt;
    }
    runtime_options o = options;
    o.trace = !trace.empty();
    if (o.device.backend == backend_kind::emulated) { o.device.emulated.memory_bytes = memory_; }
    const device dev = make_device(o.device);
    std::optional<device_buffer> filler;
    if (dev.kind() == backend_kind::cuda && dev.memory().free > memory_) {
      filler.emplace(dev, dev.memory().free - memory_);
    }
    try {
      m.log_every = 0;
      multitask::trainer t(dev, o, m, static_cast<int>(batch), steps);
      multitask::run_result r = t.run();
      if (!trace.empty()) { t.get_runtime().write_trace(trace); }
      return r;
    } catch (const out_of_memory& e) {
      last_oom_ = e.what();
      return std::nullopt;
    } catch (const config_error& e) {
      if (!refused_fails) { throw; }
      last_oom_ = e.what();
      return std::nullopt;
    }
  }

  // The trunk's activations offloaded, the budget what the workspace leaves (offloaded_budget).
  std::optional<multitask::run_result> try_offloaded(std::int64_t batch, int steps, const std::string& trace = {})
  {
    multitask::configuration c = cfg_;
    c.model.offload_activations = true;
    c.runtime.device.budget = offloaded_budget(c, batch, steps, memory_);
    if (c.runtime.device.budget == 0) { return std::nullopt; }
    return try_model(c.runtime, c.model, batch, steps, trace, true);
  }

  // The largest batch with the trunk's activations offloaded.
  std::int64_t search_offloaded(std::int64_t& probes)
  {
    return largest_fitting(
      64, std::int64_t{1} << 26,
      [&](std::int64_t batch) {
        ++probes;
        progress("activations offloaded: batch " + std::to_string(batch) + "…");
        return try_offloaded(batch, args_.probe_steps).has_value();
      },
      1000, "batch");
  }

  // Gallops up from a small batch until one does not fit, then bisects: the result fits and one
  // more sample does not.
  void search(arm& a)
  {
    const auto probe = [&](std::int64_t batch) {
      ++a.probes;
      progress(a.name + ": batch " + std::to_string(batch) + "…");
      auto r = try_batch(a.options, batch, args_.probe_steps);
      progress(a.name + ": batch " + std::to_string(batch) + (r ? " fits" : " out of memory"));
      if (r) { a.at_max = *r; }
      return r.has_value();
    };
    // Exact to one sample, or to 0.1 % where the batches are large (each probe at a GPU's batch
    // sizes re-pins the home arena and runs real steps).
    const std::int64_t fits = largest_fitting(64, std::int64_t{1} << 26, probe, 1000, "batch");
    if (fits == 0) { throw out_of_memory(a.name + ": not even a batch of 1 fits: " + last_oom_, 0, 0, memory_); }
    a.max_batch = fits;
  }

  // The deepest trunk (layers) that trains at the configuration's batch: all-resident (every unit
  // pinned, the budget their bytes) or under the configured policies (the trunk streamed).
  std::int64_t deepest_trunk(bool all_resident, std::int64_t& probes)
  {
    const std::string name = all_resident ? "all-resident" : "streamed";
    return largest_fitting(
      1, 1 << 16,
      [&](std::int64_t layers) {
        ++probes;
        multitask::model_config m = cfg_.model;
        m.trunk_layers = static_cast<int>(layers);
        progress(name + ": " + std::to_string(layers) + " trunk layers…");
        const runtime_options o =
          all_resident ? multitask::all_resident(cfg_.runtime, multitask::model_units(m)) : cfg_.runtime;
        return try_model(o, m, m.batch, args_.probe_steps).has_value();
      },
      0, "a trunk of layers");
  }

  void progress(const std::string& line)
  {
    if (args_.progress && isatty(STDERR_FILENO) == 1) { std::fprintf(stderr, "\r\033[Kheadroom: %s", line.c_str()); }
  }
  void progress_done()
  {
    if (args_.progress && isatty(STDERR_FILENO) == 1) { std::fprintf(stderr, "\r\033[K"); }
  }

 private:
  const headroom_args& args_;
  multitask::configuration cfg_;
  std::size_t memory_;
  std::string last_oom_;
};

std::string ms_text(double ms)
{
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", ms);
  return buf;
}

double percent(double a, double b) { return b == 0 ? 0 : (a - b) / b * 100.0; }

// The timed runs, the fastest of the rounds each: both arms at the batch both fit (`common`),
// taskswap also at its own largest.
struct timings {
  std::int64_t common = 0;
  std::optional<multitask::run_result> resident;
  std::optional<multitask::run_result> same;  // taskswap at `common`
  std::optional<multitask::run_result> largest;  // taskswap at its largest batch
  [[nodiscard]] double ratio() const { return resident && same ? same->step_ms() / resident->step_ms() : 0.0; }
};

// A streamed trunk: the deepest each arm trains at the configuration's batch, and the planner's.
struct trunk_depths {
  std::int64_t resident = 0;
  std::int64_t streamed = 0;
  std::int64_t predicted = 0;
  std::int64_t probes = 0;
};

// The trunk's activations offloaded, the budget what the workspace leaves: the largest batch
// measured and the planner's, and the timed runs (at timings::common and at its largest).
struct offloaded_arm {
  std::int64_t max_batch = 0;
  std::int64_t predicted = 0;
  std::int64_t probes = 0;
  std::optional<multitask::run_result> same;
  std::optional<multitask::run_result> largest;
  [[nodiscard]] double error() const
  {
    return max_batch == 0 ? 0
                          : (static_cast<double>(predicted) - static_cast<double>(max_batch)) /
                              static_cast<double>(max_batch) * 100.0;
  }
};

// Everything the report prints.
struct headroom_report {
  std::string name;
  std::string device;
  std::size_t memory = 0;
  int timed = 0;
  plan_report predicted;
  arm resident;
  arm swapped;
  timings t;
  offloaded_arm offload;
  std::optional<trunk_depths> depth;
  [[nodiscard]] double error() const
  {
    return percent(static_cast<double>(*predicted.max_batch), static_cast<double>(swapped.max_batch));
  }
};

double per_step(const multitask::run_result& r, std::size_t bytes)
{
  return static_cast<double>(bytes) / static_cast<double>(std::max<std::int64_t>(1, r.timed_steps));
}

double stall_percent(const multitask::run_result& r)
{
  return r.seconds > 0 ? r.timed.stall_ms / (r.seconds * 1e3) * 100.0 : 0.0;
}

// The planner's prediction: the batch beside the budget (the workspace of the probes), and the
// traffic of the timed runs' schedule without its first step, as the runs measure it.
plan_report predict(const multitask::configuration& cfg, const std::string& name, int timed, std::size_t memory)
{
  plan_input in = model_plan_input(cfg, timed, memory);
  in.warmup_steps = 1;
  plan_report predicted = make_plan(in);
  if (*predicted.max_batch < 1) {
    throw config_error(name + ": a budget of " + bytes_text(static_cast<double>(predicted.budget)) +
                       " leaves no room for a batch on a device of " + bytes_text(static_cast<double>(memory)) +
                       " (one sample needs " + bytes_text(static_cast<double>(predicted.bytes_per_sample)) +
                       " beside " + bytes_text(static_cast<double>(predicted.fixed_bytes)) +
                       "); lower [device] budget (this plan peaks at " +
                       bytes_text(static_cast<double>(predicted.peak_device_bytes)) + ")" +
                       (cfg.runtime.device.backend == backend_kind::emulated ? " or raise [device] memory" : ""));
  }
  return predicted;
}

// Timing, alternating the arms round by round; the fastest run of each counts.
timings time_arms(const headroom_args& args, headroom_search& search, const arm& resident, const arm& swapped,
                  offloaded_arm& offload, int timed)
{
  const auto keep_fastest = [](std::optional<multitask::run_result>& best, std::optional<multitask::run_result> r) {
    if (!r) {
      throw out_of_memory("a batch that fitted in the search did not fit when timed; the device's free memory changed",
                          0, 0, 0);
    }
    if (!best || r->step_ms() < best->step_ms()) { best = std::move(r); }
  };
  timings t;
  // The batch both fit: the all-resident one, unless a budget larger than the model leaves taskswap less.
  t.common = std::min(resident.max_batch, swapped.max_batch);
  for (int round = 0; round < args.rounds; ++round) {
    const std::string of = " (round " + std::to_string(round + 1) + " of " + std::to_string(args.rounds) + ")…";
    if (t.common > 0) {
      search.progress("timing both at batch " + std::to_string(t.common) + of);
      keep_fastest(t.resident, search.try_batch(resident.options, t.common, timed));
      keep_fastest(t.same, search.try_batch(swapped.options, t.common, timed));
      keep_fastest(offload.same, search.try_offloaded(t.common, timed));
    }
    search.progress("timing activations offloaded at batch " + std::to_string(offload.max_batch) + of);
    keep_fastest(offload.largest, search.try_offloaded(offload.max_batch, timed));
    search.progress("timing taskswap at batch " + std::to_string(swapped.max_batch) + of);
    keep_fastest(t.largest, search.try_batch(swapped.options, swapped.max_batch, timed,
                                             round + 1 == args.rounds ? args.trace : std::string()));
  }
  return t;
}

trunk_depths measure_depths(headroom_search& search, const multitask::configuration& cfg, int timed, std::size_t memory)
{
  trunk_depths d;
  d.resident = search.deepest_trunk(true, d.probes);
  d.streamed = search.deepest_trunk(false, d.probes);
  d.predicted = largest_fitting(
    1, 1 << 16,
    [&](std::int64_t layers) {
      multitask::configuration c = cfg;
      c.model.trunk_layers = static_cast<int>(layers);
      try {
        const plan_report p = make_plan(model_plan_input(c, timed, memory));
        return p.max_batch.value_or(0) >= c.model.batch;
      } catch (const config_error&) {
        return false;
      }
    },
    0, "a trunk of layers");
  return d;
}

// A row of the table: the label, then all-resident, taskswap, the planner's, activations
// offloaded and the planner's for it.
void row(const std::string& label, const std::string& resident, const std::string& swapped, const std::string& planned,
         const std::string& offloaded, const std::string& offload_planned)
{
  std::printf("  %-28s %14s %14s %20s %14s %20s\n", label.c_str(), resident.c_str(), swapped.c_str(), planned.c_str(),
              offloaded.c_str(), offload_planned.c_str());
}

void print_table(const headroom_report& r, const multitask::configuration& cfg)
{
  const auto b = [](double v) { return bytes_text(v); };
  const auto n = [](std::int64_t v) { return std::to_string(v); };
  const auto pct = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f%%", v);
    return std::string(buf);
  };
  const timings& t = r.t;
  const offloaded_arm& o = r.offload;
  multitask::configuration off = cfg;
  off.model.offload_activations = true;
  const std::size_t off_budget = offloaded_budget(off, o.max_batch, r.timed, r.memory);
  row("", "all-resident", "taskswap", "planner (taskswap)", "activations", "planner (offloaded)");
  row("", "", "", "", "offloaded", "");
  row("budget", b(static_cast<double>(r.resident.options.device.budget)),
      b(static_cast<double>(r.swapped.options.device.budget)), b(static_cast<double>(r.predicted.budget)),
      b(static_cast<double>(off_budget)), "memory - workspace");
  row("largest batch", n(r.resident.max_batch), n(r.swapped.max_batch), n(*r.predicted.max_batch), n(o.max_batch),
      n(o.predicted));
  if (t.resident && t.same) {
    row("step time, batch " + n(t.common), ms_text(t.resident->step_ms()), ms_text(t.same->step_ms()), "",
        o.same ? ms_text(o.same->step_ms()) : "-", "");
  }
  row("step time, largest batch", "-", ms_text(t.largest->step_ms()), "", ms_text(o.largest->step_ms()), "");
  row("stall (largest batch)", pct(t.resident ? stall_percent(*t.resident) : 0.0), pct(stall_percent(*t.largest)), "",
      pct(stall_percent(*o.largest)), "");
  row("h2d per step", t.resident ? b(per_step(*t.resident, t.resident->timed.h2d_bytes)) : "-",
      b(per_step(*t.largest, t.largest->timed.h2d_bytes)), b(r.predicted.h2d_bytes_per_step),
      b(per_step(*o.largest, o.largest->timed.h2d_bytes)), "");
  row("d2h per step", t.resident ? b(per_step(*t.resident, t.resident->timed.d2h_bytes)) : "-",
      b(per_step(*t.largest, t.largest->timed.d2h_bytes)), b(r.predicted.d2h_bytes_per_step),
      b(per_step(*o.largest, o.largest->timed.d2h_bytes)), "");
  if (r.predicted.link_bytes_per_second > 0) {
    row("transfer time per step", "", "", ms_text(r.predicted.transfer_ms_per_step), "", "");
  }
}

void print_report(const headroom_report& r, const multitask::configuration& cfg, const headroom_args& args)
{
  const auto b = [](double v) { return bytes_text(v); };
  std::printf("taskswap headroom, %s: %s, %s of device memory for the budget and the activations\n", r.name.c_str(),
              r.device.c_str(), b(static_cast<double>(r.memory)).c_str());
  std::printf("  model: %d tasks, %d trunk layers, width %d, adapters %d→%d→%d, %s; %s of activations per sample\n\n",
              cfg.model.tasks, cfg.model.trunk_layers, cfg.model.width, cfg.model.width, cfg.model.adapter_hidden,
              cfg.model.outputs, std::string(to_string(cfg.model.compute)).c_str(),
              b(static_cast<double>(r.predicted.bytes_per_sample)).c_str());
  print_table(r, cfg);
  const std::int64_t res = r.resident.max_batch;
  const std::int64_t swp = r.swapped.max_batch;
  std::printf("\n  taskswap trains a %.2fx larger batch (%lld vs %lld); at the same batch its step takes %.3fx "
              "as long; the planner's batch is %+.2f %% off the measured one\n",
              res > 0 ? static_cast<double>(swp) / static_cast<double>(res) : 0.0, static_cast<long long>(swp),
              static_cast<long long>(res), r.t.ratio(), r.error());
  const offloaded_arm& o = r.offload;
  const auto over = [&](const std::optional<multitask::run_result>& base) {
    return o.same && base ? o.same->step_ms() / base->step_ms() : 0.0;
  };
  std::printf("  with the trunk's activations offloaded it trains a %.2fx larger batch than all-resident (%lld); at "
              "batch %lld its step takes %.3fx taskswap's without offload and %.3fx all-resident's (its budget what "
              "the workspace leaves); the planner's batch is %+.2f %% off the measured one\n",
              res > 0 ? static_cast<double>(o.max_batch) / static_cast<double>(res) : 0.0,
              static_cast<long long>(o.max_batch), static_cast<long long>(r.t.common), over(r.t.same),
              over(r.t.resident), o.error());
  if (swp <= res) {
    std::printf(
      "  the budget (%s) leaves taskswap no larger batch: this plan peaks at %s; lower [device] budget toward it\n",
      b(static_cast<double>(r.predicted.budget)).c_str(),
      b(static_cast<double>(r.predicted.peak_device_bytes)).c_str());
  }
  if (r.depth) {
    const trunk_depths& d = *r.depth;
    std::printf("\n  %-28s %14lld %14lld %20lld\n", ("deepest trunk, batch " + std::to_string(cfg.model.batch)).c_str(),
                static_cast<long long>(d.resident), static_cast<long long>(d.streamed),
                static_cast<long long>(d.predicted));
    std::printf("  streaming trains a %.2fx deeper trunk (%lld vs %lld layers) in the same device memory; the "
                "planner's depth is %+.2f %% off the measured one (%lld probes)\n",
                d.resident > 0 ? static_cast<double>(d.streamed) / static_cast<double>(d.resident) : 0.0,
                static_cast<long long>(d.streamed), static_cast<long long>(d.resident),
                percent(static_cast<double>(d.predicted), static_cast<double>(d.streamed)),
                static_cast<long long>(d.probes));
  }
  std::printf("  (%lld + %lld + %lld probes of %d steps; timed runs of %d steps, the fastest of %d rounds)\n",
              static_cast<long long>(r.resident.probes), static_cast<long long>(r.swapped.probes),
              static_cast<long long>(r.offload.probes), args.probe_steps, r.timed, args.rounds);
}

void write_report(const headroom_report& r, const headroom_args& args)
{
  const timings& t = r.t;
  nlohmann::json j{{"config", r.name},
                   {"device", r.device},
                   {"device_memory", r.memory},
                   {"max_batch_resident", r.resident.max_batch},
                   {"max_batch_taskswap", r.swapped.max_batch},
                   {"predicted_max_batch_taskswap", *r.predicted.max_batch},
                   {"predicted_max_batch_resident", *r.predicted.max_batch_all_resident},
                   {"prediction_error_percent", r.error()},
                   {"step_time_ratio", t.ratio()},
                   {"step_ms_resident", t.resident ? t.resident->step_ms() : 0.0},
                   {"step_ms_taskswap_same_batch", t.same ? t.same->step_ms() : 0.0},
                   {"step_ms_taskswap_max_batch", t.largest->step_ms()},
                   {"stall_percent_taskswap", stall_percent(*t.largest)},
                   {"h2d_bytes_per_step", per_step(*t.largest, t.largest->timed.h2d_bytes)},
                   {"d2h_bytes_per_step", per_step(*t.largest, t.largest->timed.d2h_bytes)},
                   {"predicted_h2d_bytes_per_step", r.predicted.h2d_bytes_per_step},
                   {"predicted_d2h_bytes_per_step", r.predicted.d2h_bytes_per_step},
                   {"budget_resident", r.resident.options.device.budget},
                   {"budget_taskswap", r.swapped.options.device.budget},
                   {"probes", r.resident.probes + r.swapped.probes},
                   {"probe_steps", args.probe_steps},
                   {"timed_steps", r.timed},
                   {"rounds", args.rounds}};
  const offloaded_arm& o = r.offload;
  j["max_batch_offloaded"] = o.max_batch;
  j["predicted_max_batch_offloaded"] = o.predicted;
  j["prediction_error_percent_offloaded"] = o.error();
  j["step_ms_offloaded_same_batch"] = o.same ? o.same->step_ms() : 0.0;
  j["step_ms_offloaded_max_batch"] = o.largest->step_ms();
  j["step_time_ratio_offloaded"] = o.same && t.same ? o.same->step_ms() / t.same->step_ms() : 0.0;
  j["step_time_ratio_offloaded_resident"] = o.same && t.resident ? o.same->step_ms() / t.resident->step_ms() : 0.0;
  j["stall_percent_offloaded"] = stall_percent(*o.largest);
  j["h2d_bytes_per_step_offloaded"] = per_step(*o.largest, o.largest->timed.h2d_bytes);
  j["d2h_bytes_per_step_offloaded"] = per_step(*o.largest, o.largest->timed.d2h_bytes);
  j["probes"] = r.resident.probes + r.swapped.probes + o.probes;
  if (r.depth) {
    j["max_trunk_layers_resident"] = r.depth->resident;
    j["max_trunk_layers_streamed"] = r.depth->streamed;
    j["predicted_max_trunk_layers_streamed"] = r.depth->predicted;
  }
  write_json(j, args.json);
}

}  // namespace

int run_headroom(const headroom_args& args)
{
  headroom_report r;
  const multitask::configuration cfg = load_or_default(args.config, r.name);
  if (cfg.runtime.device.backend == backend_kind::cuda && cuda_device_count() <= cfg.runtime.device.index) {
    throw invalid_argument(r.name + " names CUDA device " + std::to_string(cfg.runtime.device.index) + " but " +
                           std::to_string(cuda_device_count()) +
                           " are usable here; run on a GPU machine, or use [device] backend = \"emulated\"");
  }
  r.memory = device_memory_for(cfg, args.device_memory);
  if (r.memory == 0) {
    throw invalid_argument(
      "no CUDA device is usable here; run on a GPU machine, or use [device] backend = \"emulated\"");
  }
  r.timed = std::max(args.timed_steps, 2);
  r.predicted = predict(cfg, r.name, r.timed, r.memory);
  headroom_search search(args, cfg, r.memory);
  r.resident = {.name = "all-resident",
                .options = multitask::all_resident(cfg.runtime, multitask::model_units(cfg.model))};
  r.swapped = {.name = "taskswap", .options = cfg.runtime};
  search.search(r.resident);
  search.search(r.swapped);
  r.offload.max_batch = search.search_offloaded(r.offload.probes);
  r.offload.predicted = offloaded_batch(cfg, args.probe_steps, r.memory);
  r.t = time_arms(args, search, r.resident, r.swapped, r.offload, r.timed);
  if (multitask::trunk_streams(cfg.model, cfg.runtime)) { r.depth = measure_depths(search, cfg, r.timed, r.memory); }
  search.progress_done();
  r.device = cfg.runtime.device.backend == backend_kind::emulated ? "the emulated device"
                                                                  : cuda_device(cfg.runtime.device.index).name();
  print_report(r, cfg, args);
  if (!args.json.empty()) { write_report(r, args); }
  return 0;
}

}  // namespace taskswap::tools
