// SPDX-License-Identifier: Apache-2.0
#include "runtime/trace.hpp"

#include "device/message.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>

namespace taskswap::detail {

namespace {

void write_json_string(std::ostream& out, const std::string& s)
{
  out << '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out << buf;
    } else {
      out << c;
    }
  }
  out << '"';
}

}  // namespace

trace_recorder::trace_recorder(const device& dev, stream_view idle_stream)
    : device_(dev), origin_(dev, event_options{.timing = true})
{
  origin_.record(idle_stream);
  origin_.synchronize();
  origin_time_ = clock::now();
}

int trace_recorder::track(const std::string& name)
{
  const auto it = std::find(tracks_.begin(), tracks_.end(), name);
  if (it != tracks_.end()) { return static_cast<int>(it - tracks_.begin()); }
  tracks_.push_back(name);
  return static_cast<int>(tracks_.size() - 1);
}

std::size_t trace_recorder::open(int track, std::string name, stream_view s)
{
  if (device_spans_.size() >= max_spans) {
    ++dropped_;
    return dropped;
  }
  device_spans_.push_back(device_span_record{track, std::move(name), event(device_, event_options{.timing = true}),
                                             event(device_, event_options{.timing = true})});
  device_spans_.back().begin.record(s);
  return device_spans_.size() - 1;
}

void trace_recorder::close(std::size_t span, stream_view s)
{
  if (span != dropped) { device_spans_[span].end.record(s); }
}

void trace_recorder::host_span(int track, std::string name, clock::time_point begin, clock::time_point end)
{
  const std::lock_guard lock(host_mutex_);
  if (host_spans_.size() >= max_spans) {
    ++dropped_;
    return;
  }
  host_spans_.push_back(host_span_record{track, std::move(name), begin, end});
}

void trace_recorder::counter(const std::string& name, double value)
{
  if (counters_.size() >= max_spans) { return; }
  counters_.push_back(counter_record{name, clock::now(), value});
}

void trace_recorder::write(const std::filesystem::path& file)
{
  std::ofstream out(file);
  if (!out) { throw invalid_argument(message("cannot write the trace to '", file.string(), "'; check the path")); }
  const auto host_us = [&](clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - origin_time_).count();
  };
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  const auto sep = [&] {
    if (!first) { out << ",\n"; }
    first = false;
  };
  for (std::size_t t = 0; t < tracks_.size(); ++t) {
    sep();
    out << R"({"ph":"M","pid":1,"tid":)" << t << R"(,"name":"thread_name","args":{"name":)";
    write_json_string(out, tracks_[t]);
    out << "}}";
  }
  for (const device_span_record& s : device_spans_) {
    if (!s.end.recorded()) { continue; }  // still open: an acquisition not yet released
    s.end.synchronize();
    const double begin = elapsed_ms(origin_, s.begin) * 1000.0;
    const double end = elapsed_ms(origin_, s.end) * 1000.0;
    sep();
    out << R"({"ph":"X","pid":1,"tid":)" << s.track << ",\"name\":";
    write_json_string(out, s.name);
    out << ",\"ts\":" << begin << ",\"dur\":" << std::max(0.0, end - begin) << "}";
  }
  {
    const std::lock_guard lock(host_mutex_);
    for (const host_span_record& s : host_spans_) {
      sep();
      out << R"({"ph":"X","pid":1,"tid":)" << s.track << ",\"name\":";
      write_json_string(out, s.name);
      out << ",\"ts\":" << host_us(s.begin) << ",\"dur\":" << host_us(s.end) - host_us(s.begin) << "}";
    }
  }
  for (const counter_record& c : counters_) {
    sep();
    out << R"({"ph":"C","pid":1,"name":)";
    write_json_string(out, c.name);
    out << ",\"ts\":" << host_us(c.at) << ",\"args\":{\"bytes\":" << c.value << "}}";
  }
  out << "\n],\"otherData\":{\"dropped_spans\":" << dropped_ << "}}\n";
  if (!out) { throw invalid_argument(message("writing the trace to '", file.string(), "' failed")); }
}

}  // namespace taskswap::detail
