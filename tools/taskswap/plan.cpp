// SPDX-License-Identifier: Apache-2.0
// `taskswap plan CONFIG`: the planner's predictions for the model and policies of a configuration.

#include "commands.hpp"
#include "embedded_configs.hpp"

#include <cstdio>
#include <fstream>
#include <iostream>

namespace taskswap::tools {

multitask::configuration load_or_default(const std::string& file, std::string& name)
{
  if (!file.empty()) {
    name = file;
    return multitask::load_configuration(file);
  }
  const bool gpu = cuda_device_count() > 0;
  name = gpu ? "the embedded samples/configs/cuda.toml" : "the embedded samples/configs/emulated.toml";
  return multitask::parse_configuration(gpu ? embedded_cuda_config : embedded_emulated_config, name);
}

std::size_t device_memory_for(const multitask::configuration& cfg, const std::optional<std::string>& cap)
{
  const runtime_options& o = cfg.runtime;
  std::size_t memory = 0;
  if (o.device.backend == backend_kind::emulated) {
    memory = o.device.emulated.memory_bytes != 0 ? o.device.emulated.memory_bytes : o.device.budget;
  } else if (cuda_device_count() > o.device.index) {
    memory = cuda_device(o.device.index).memory().free;
  }
  const std::size_t limit = cap ? parse_size(*cap) : cfg.headroom_device_memory;
  if (limit != 0) { memory = memory == 0 ? limit : std::min(memory, limit); }
  return memory;
}

plan_input model_plan_input(const multitask::configuration& cfg, int steps, std::size_t device_memory)
{
  plan_input in;
  in.options = cfg.runtime;
  in.units = multitask::model_units(cfg.model);
  const std::size_t trunk = static_cast<std::size_t>(cfg.model.trunk_layers);
  for (int s = 0; s < steps; ++s) {
    std::vector<std::size_t> step;
    std::vector<std::size_t> frozen;  // the trunk, from [model] freeze_trunk_after on
    for (std::size_t l = 0; l < trunk; ++l) { (cfg.model.trunk_frozen(s) ? frozen : step).push_back(l); }
    for (const int t : multitask::tasks_of_step(cfg.model, 0, s)) {
      step.push_back(trunk + static_cast<std::size_t>(t));
    }
    in.steps.push_back(std::move(step));
    in.frozen.push_back(std::move(frozen));
  }
  // A trunk the trainer streams, or activation blocks: its calls in order (the peak is then one
  // layer or two, not the trunk; a block is stashed and read back).
  const bool streams = multitask::trunk_streams(cfg.model, cfg.runtime);
  if (streams || cfg.model.offload_activations) {
    std::vector<unit_id> layers;
    std::vector<unit_id> blocks;  // after the trunk and the adapters (model_units)
    for (std::size_t l = 0; l < trunk; ++l) { layers.push_back(unit_id{static_cast<std::uint32_t>(l)}); }
    for (std::size_t b = trunk + static_cast<std::size_t>(cfg.model.tasks); b < in.units.size(); ++b) {
      blocks.push_back(unit_id{static_cast<std::uint32_t>(b)});
    }
    for (int s = 0; s < steps; ++s) {
      std::vector<unit_id> adapters;
      for (const int t : multitask::tasks_of_step(cfg.model, 0, s)) {
        adapters.push_back(unit_id{static_cast<std::uint32_t>(trunk + static_cast<std::size_t>(t))});
      }
      in.ordered.push_back(multitask::step_plan_of(cfg.model, layers, adapters, s, streams, blocks));
    }
  }
  in.plan_window = static_cast<std::size_t>(cfg.model.plan_window);
  in.plan_margin = static_cast<std::size_t>(multitask::plan_margin(cfg.model, cfg.runtime));
  in.device_memory = device_memory;
  // The pool's mapping granule: the emulated device's setting, or the CUDA device's (2 MiB on
  // every GPU CUDA 12 and 13 support, assumed where there is no device to ask).
  if (cfg.runtime.device.backend == backend_kind::emulated) {
    in.granule = cfg.runtime.device.emulated.granularity;
  } else {
    in.granule = cuda_device_count() > cfg.runtime.device.index ? cuda_device(cfg.runtime.device.index).granularity()
                                                                : std::size_t{2} << 20U;
  }
  const multitask::workspace_size w = multitask::model_workspace(cfg.model, steps);
  in.fixed_bytes = w.fixed;
  in.bytes_per_sample = w.per_sample;
  if (cfg.runtime.device.backend == backend_kind::emulated && cfg.runtime.device.emulated.link.enabled()) {
    in.link_bytes_per_second = cfg.runtime.device.emulated.link.bytes_per_second;
    in.link_source = "[device] link_bandwidth";
  }
  return in;
}

std::int64_t largest_fitting(std::int64_t start, std::int64_t limit, const std::function<bool(std::int64_t)>& fits,
                             std::int64_t fraction, const std::string& what)
{
  std::int64_t fit = 0;
  std::int64_t fails = -1;
  for (std::int64_t v = start; fails < 0 && v <= limit; v *= 2) {
    if (fits(v)) {
      fit = v;
    } else {
      fails = v;
    }
  }
  if (fails < 0) {
    throw invalid_argument(what + " of " + std::to_string(fit) + " still fits; the search stops there");
  }
  while (fails - fit > std::max<std::int64_t>(1, fraction > 0 ? fit / fraction : 1)) {
    const std::int64_t mid = fit + (fails - fit) / 2;
    (fits(mid) ? fit : fails) = mid;
  }
  return fit;
}

std::size_t offloaded_budget(const multitask::configuration& cfg, std::int64_t batch, int steps, std::size_t memory)
{
  const std::size_t workspace =
    multitask::model_workspace(cfg.model, steps).bytes(static_cast<std::size_t>(std::max<std::int64_t>(batch, 0)));
  return workspace >= memory ? 0 : (memory - workspace) / 256 * 256;
}

std::int64_t offloaded_batch(const multitask::configuration& cfg, int steps, std::size_t memory,
                             std::optional<std::size_t> budget)
{
  const auto fits = [&](std::int64_t batch) {
    multitask::configuration c = cfg;
    c.model.offload_activations = true;
    c.model.batch = static_cast<int>(batch);
    const std::size_t left = offloaded_budget(c, batch, steps, memory);
    c.runtime.device.budget = budget ? (*budget <= left ? *budget : 0) : left;
    if (c.runtime.device.budget == 0 || batch < c.model.tasks_per_step) { return false; }
    try {
      (void)make_plan(model_plan_input(c, steps, 0));
      return true;
    } catch (const config_error&) {
      return false;  // a step of the plan does not fit the budget this batch leaves
    }
  };
  return largest_fitting(1, std::int64_t{1} << 26, fits, 0, "an offloaded batch");
}

void write_json(const nlohmann::json& j, const std::string& file)
{
  if (file == "-") {
    std::cout << j.dump(2) << "\n";
    return;
  }
  const std::string tmp = file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) { throw invalid_argument("cannot write '" + file + "'; check the directory"); }
    out << j.dump(2) << "\n";
    if (!out.flush()) { throw invalid_argument("writing '" + file + "' failed"); }
  }
  std::filesystem::rename(tmp, file);
}

namespace {

std::string batch_text(const std::optional<std::int64_t>& b, bool memory_known)
{
  if (!memory_known) { return "unknown (give --device-memory)"; }
  return b ? std::to_string(*b) : "-";
}

}  // namespace

namespace {

// The link's and the drive's rates the plan's times use: given, measured, or unknown.
void set_rates(const plan_args& args, const multitask::configuration& cfg, const std::string& name, plan_input& in)
{
  if (args.link_rate) {
    in.link_bytes_per_second = parse_rate(*args.link_rate);
    in.link_source = "--link-rate";
  } else if (args.measure_link || (in.link_bytes_per_second == 0 && cfg.runtime.device.backend == backend_kind::cuda &&
                                   cuda_device_count() > cfg.runtime.device.index)) {
    const device dev = make_device(cfg.runtime.device);
    const std::size_t bytes = std::min(std::size_t{256} << 20U, dev.memory().free / 4 / 4096 * 4096);
    in.link_bytes_per_second = measure_copies(dev, -1, bytes, 3).h2d;
    in.link_source = "measured host→device on " + dev.name();
  }
  if (args.disk_read_rate.has_value() != args.disk_write_rate.has_value()) {
    throw config_error("give both --disk-read-rate and --disk-write-rate (taskswap probe --storage measures them)");
  }
  if (args.disk_read_rate) {
    if (args.measure_disk) { throw config_error("give --measure-disk or the disk rates, not both"); }
    in.disk_read_bytes_per_second = parse_rate(*args.disk_read_rate);
    in.disk_write_bytes_per_second = parse_rate(*args.disk_write_rate);
    in.disk_source = "--disk-read-rate, --disk-write-rate";
  } else if (args.measure_disk) {
    const std::filesystem::path& dir = cfg.runtime.storage.path;
    if (dir.empty()) {
      throw config_error("--measure-disk measures the drive of [storage] path, and " + name +
                         " has none; add [storage] path or give --disk-read-rate and --disk-write-rate");
    }
    if (disk_homed_units(in) == 0) {
      throw config_error(name + " homes no unit on disk (no [[units]] rule with home = \"disk\" matches): "
                                "--measure-disk has no disk traffic to judge");
    }
    const bool made = !std::filesystem::exists(dir);
    const storage_rates d = measure_storage_rates(dir, std::size_t{64} << 20U, 3);
    if (made) {
      std::error_code ignored;
      std::filesystem::remove(dir, ignored);  // the directory it made for the measurement, empty again
    }
    in.disk_read_bytes_per_second = d.read;
    in.disk_write_bytes_per_second = d.write;
    in.disk_source = "measured in " + dir.string() + (d.direct ? "" : ", buffered: no O_DIRECT there");
  }
}

// The disk homes' part of the printed plan.
void print_disk(const plan_report& r)
{
  const auto b = [](double v) { return bytes_text(v); };
  std::printf("  %-34s %zu units, %s in unit files\n", "disk homes", r.disk_units,
              b(static_cast<double>(r.disk_bytes)).c_str());
  std::printf("  %-34s %s (one step keeps at most %s of disk homes in use at once)\n", "host cache",
              b(static_cast<double>(r.host_cache_bytes)).c_str(),
              b(static_cast<double>(r.host_cache_step_bytes)).c_str());
  std::printf("  %-34s %s read, %s written\n", "disk per step", b(r.disk_read_bytes_per_step).c_str(),
              b(r.disk_write_bytes_per_step).c_str());
  if (r.disk_ms_per_step > 0) {
    std::printf("  %-34s %.3f ms at %.2f GB/s read, %.2f GB/s write (%s)\n", "disk time per step", r.disk_ms_per_step,
                r.disk_read_bytes_per_second / 1e9, r.disk_write_bytes_per_second / 1e9, r.disk_source.c_str());
    // The drive's reads and writes overlap the step's compute and copies: it keeps up with steps
    // at least that long.
    std::printf("  %-34s with steps of %.3f ms or more", "the drive keeps up", r.disk_ms_per_step);
    if (r.transfer_ms_per_step > 0) {
      std::printf(" (%.2fx the host-device transfer time per step)", r.disk_ms_per_step / r.transfer_ms_per_step);
    }
    std::printf("\n");
  } else {
    std::printf("  %-34s unknown (give --measure-disk, or --disk-read-rate and --disk-write-rate)\n",
                "disk time per step");
  }
  if (r.host_cache_step_bytes > r.host_cache_bytes) {
    std::printf("  note: one step keeps %s of disk homes in use at once, more than the %s host cache: it reads "
                "some again within the step; raise [storage] host_cache\n",
                b(static_cast<double>(r.host_cache_step_bytes)).c_str(),
                b(static_cast<double>(r.host_cache_bytes)).c_str());
  }
}

void print_plan(const plan_report& r, const std::string& name)
{
  const auto b = [](double v) { return bytes_text(v); };
  std::printf("taskswap plan %s: %zu units (%zu pinned), %zu steps of the sample model's schedule\n", name.c_str(),
              r.units, r.pinned_units, r.steps);
  std::printf("  %-34s %s\n", "budget", b(static_cast<double>(r.budget)).c_str());
  std::printf("  %-34s %s (pinned units %s)\n", "peak device bytes",
              b(static_cast<double>(r.peak_device_bytes)).c_str(),
              b(static_cast<double>(r.pinned_device_bytes)).c_str());
  std::printf("  %-34s %s of the peak, in whole granules of %s\n", "granule rounding",
              b(static_cast<double>(r.rounding_bytes)).c_str(), b(static_cast<double>(r.granule)).c_str());
  std::printf("  %-34s %s\n", "all units resident would need", b(static_cast<double>(r.all_resident_bytes)).c_str());
  std::printf("  %-34s %s\n", "pinned host bytes (home arena)", b(static_cast<double>(r.pinned_host_bytes)).c_str());
  if (r.disk_units > 0) { print_disk(r); }
  std::printf("  %-34s %s h2d, %s d2h, %.2f swap-ins\n", "moved per step", b(r.h2d_bytes_per_step).c_str(),
              b(r.d2h_bytes_per_step).c_str(), r.swap_ins_per_step);
  if (r.link_bytes_per_second > 0) {
    std::printf("  %-34s %.3f ms at %.2f GB/s (%s)\n", "transfer time per step", r.transfer_ms_per_step,
                r.link_bytes_per_second / 1e9, r.link_source.c_str());
  } else {
    std::printf("  %-34s unknown (give --link-rate or --measure-link)\n", "transfer time per step");
  }
  const bool known = r.device_memory > 0;
  std::printf("  %-34s %s, %s + %s per sample beside the budget\n", "device memory",
              known ? b(static_cast<double>(r.device_memory)).c_str() : "unknown",
              b(static_cast<double>(r.fixed_bytes)).c_str(), b(static_cast<double>(r.bytes_per_sample)).c_str());
  std::printf("  %-34s %s\n", "largest batch (these policies)", batch_text(r.max_batch, known).c_str());
  std::printf("  %-34s %s\n", "largest batch (all resident)", batch_text(r.max_batch_all_resident, known).c_str());
  if (r.max_batch_offloaded) {
    std::printf("  %-34s %lld\n", "largest batch (budget = the rest)", static_cast<long long>(*r.max_batch_offloaded));
  }
  if (r.budget > r.peak_device_bytes && !r.max_batch_offloaded) {  // offloaded: the peak grows with the batch
    std::printf("  note: this plan peaks at %s; a budget that size leaves %s more for activations\n",
                b(static_cast<double>(r.peak_device_bytes)).c_str(),
                b(static_cast<double>(r.budget - r.peak_device_bytes)).c_str());
  }
}

void write_plan_json(const plan_report& r, const std::string& name, const std::string& path)
{
  nlohmann::json j{
    {"config", name},
    {"units", r.units},
    {"pinned_units", r.pinned_units},
    {"steps", r.steps},
    {"budget", r.budget},
    {"peak_device_bytes", r.peak_device_bytes},
    {"pinned_device_bytes", r.pinned_device_bytes},
    {"granule", r.granule},
    {"rounding_bytes", r.rounding_bytes},
    {"all_resident_bytes", r.all_resident_bytes},
    {"pinned_host_bytes", r.pinned_host_bytes},
    {"h2d_bytes_per_step", r.h2d_bytes_per_step},
    {"d2h_bytes_per_step", r.d2h_bytes_per_step},
    {"swap_ins_per_step", r.swap_ins_per_step},
    {"link_bytes_per_second", r.link_bytes_per_second},
    {"link_source", r.link_source},
    {"transfer_ms_per_step", r.transfer_ms_per_step},
    {"disk_units", r.disk_units},
    {"disk_bytes", r.disk_bytes},
    {"host_cache_bytes", r.host_cache_bytes},
    {"host_cache_step_bytes", r.host_cache_step_bytes},
    {"disk_read_bytes_per_step", r.disk_read_bytes_per_step},
    {"disk_write_bytes_per_step", r.disk_write_bytes_per_step},
    {"disk_read_bytes_per_second", r.disk_read_bytes_per_second},
    {"disk_write_bytes_per_second", r.disk_write_bytes_per_second},
    {"disk_ms_per_step", r.disk_ms_per_step},
    {"disk_source", r.disk_source},
    {"device_memory", r.device_memory},
    {"fixed_bytes", r.fixed_bytes},
    {"bytes_per_sample", r.bytes_per_sample},
    {"max_batch", r.max_batch ? nlohmann::json(*r.max_batch) : nlohmann::json(nullptr)},
    {"max_batch_offloaded", r.max_batch_offloaded ? nlohmann::json(*r.max_batch_offloaded) : nlohmann::json(nullptr)},
    {"max_batch_all_resident",
     r.max_batch_all_resident ? nlohmann::json(*r.max_batch_all_resident) : nlohmann::json(nullptr)}};
  write_json(j, path);
}

}  // namespace

int run_plan(const plan_args& args)
{
  std::string name;
  const multitask::configuration cfg = load_or_default(args.config, name);
  const int steps = args.steps > 0 ? args.steps : cfg.model.steps;
  plan_input in = model_plan_input(cfg, steps, device_memory_for(cfg, args.device_memory));
  if (args.bytes_per_sample) { in.bytes_per_sample = *args.bytes_per_sample; }
  set_rates(args, cfg, name, in);
  plan_report r = make_plan(in);
  if (cfg.model.offload_activations && in.device_memory > 0) {
    // The activation blocks grow with the batch, in the budget: the largest batch is where the plan
    // check or the workspace beside the budget stops it; all-resident keeps its activations.
    r.max_batch = offloaded_batch(cfg, steps, in.device_memory, cfg.runtime.device.budget);
    r.max_batch_offloaded = offloaded_batch(cfg, steps, in.device_memory);
    multitask::configuration kept = cfg;
    kept.model.offload_activations = false;
    r.max_batch_all_resident = make_plan(model_plan_input(kept, steps, in.device_memory)).max_batch_all_resident;
  }
  print_plan(r, name);
  if (!args.json.empty()) { write_plan_json(r, name, args.json); }
  return 0;
}

}  // namespace taskswap::tools
