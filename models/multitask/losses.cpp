// SPDX-License-Identifier: Apache-2.0
// The trainer's reports: a log line of an interval's losses, each task's losses over a run, and
// the step figures of the steps after the warm-up.

#include "model_internal.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace multitask::detail {

std::string interval_line(const model_config& m, int rank, int world, const float* losses, std::int64_t first,
                          std::int64_t end, std::size_t reduced_bytes)
{
  const auto per_step = static_cast<std::size_t>(m.tasks_per_step);
  std::vector<double> sum(static_cast<std::size_t>(m.tasks), 0.0);
  std::vector<int> count(static_cast<std::size_t>(m.tasks), 0);
  for (std::int64_t s = first; s < end; ++s) {
    const std::vector<int> task = tasks_of_step(m, rank, s);
    for (std::size_t j = 0; j < task.size(); ++j) {
      sum[static_cast<std::size_t>(task[j])] += losses[static_cast<std::size_t>(s) * per_step + j];
      ++count[static_cast<std::size_t>(task[j])];
    }
  }
  std::ostringstream line;
  line << "step " << end << ": mean loss ";
  double all = 0;
  for (const double t : sum) { all += t; }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4f", all / static_cast<double>(end - first) / static_cast<double>(per_step));
  line << buf << " over " << (end - first) << " steps;";
  int shown = 0;
  for (std::size_t t = 0; t < sum.size() && shown < 6; ++t) {
    if (count[t] == 0) { continue; }
    std::snprintf(buf, sizeof buf, " task/%zu %.4f", t, sum[t] / count[t]);
    line << buf;
    ++shown;
  }
  if (world > 1) {
    std::snprintf(buf, sizeof buf, "; reduced %.1f KiB/step",
                  static_cast<double>(reduced_bytes) / 1024.0 / static_cast<double>(end - first));
    line << buf;
  }
  return line.str();
}

void summarise_losses(const model_config& m, int rank, const float* losses, std::int64_t begin, std::int64_t end_at,
                      run_result& r)
{
  const auto per_step = static_cast<std::size_t>(m.tasks_per_step);
  for (std::int64_t s = begin; s < end_at; ++s) {
    const std::vector<int> task = tasks_of_step(m, rank, s);
    for (std::size_t j = 0; j < task.size(); ++j) {
      task_losses& t = r.tasks[static_cast<std::size_t>(task[j])];
      t.all.push_back(losses[static_cast<std::size_t>(s) * per_step + j]);
      ++t.steps;
    }
  }
  for (task_losses& t : r.tasks) {
    if (t.all.empty()) { continue; }
    const std::size_t k = std::max<std::size_t>(1, std::min<std::size_t>(3, t.all.size() / 2));
    double first = 0;
    double last = 0;
    for (std::size_t i = 0; i < k; ++i) {
      first += t.all[i];
      last += t.all[t.all.size() - 1 - i];
    }
    t.first = static_cast<float>(first / static_cast<double>(k));
    t.last = static_cast<float>(last / static_cast<double>(k));
  }
}

void add_step_figures(taskswap::runtime& rt, std::int64_t begin, run_result& r)
{
  const taskswap::runtime_stats stats = rt.stats();
  r.total = stats.total;
  if (rt.guards_steps()) { r.scaler = rt.scaler_state(); }
  r.disk = stats.disk;
  for (const taskswap::step_stats& st : stats.steps) {  // the steps after the warm-up (the last 4096)
    if (st.step <= static_cast<std::uint64_t>(begin)) { continue; }
    r.timed.h2d_bytes += st.h2d_bytes;
    r.timed.d2h_bytes += st.d2h_bytes;
    r.timed.swap_ins += st.swap_ins;
    r.timed.write_backs += st.write_backs;
    r.timed.hits += st.hits;
    r.timed.misses += st.misses;
    r.timed.stall_ms += st.stall_ms;
    r.timed.reduced_bytes += st.reduced_bytes;
    r.timed.evictions += st.evictions;
    r.timed.unplanned += st.unplanned;
    r.timed.peak_device_bytes = std::max(r.timed.peak_device_bytes, st.peak_device_bytes);
  }
}

}  // namespace multitask::detail
