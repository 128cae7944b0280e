// SPDX-License-Identifier: Apache-2.0
#pragma once

// Spans and counters for a Chrome trace (JSON; opens in Perfetto). Device spans are bracketed by
// timing events on their stream and placed on the host clock through an origin event recorded
// on an idle stream when the recorder is made; host spans and counters use the host clock.
// Event times are read only when the trace is written.

#include <taskswap/device.hpp>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace taskswap::detail {

class trace_recorder {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::size_t max_spans = 200'000;  // beyond it spans are counted, not kept

  trace_recorder(const device& dev, stream_view idle_stream);

  /// A track (a row in Perfetto); the same name gives the same track.
  int track(const std::string& name);
  /// Starts a device span on `s`; the handle goes to close().
  std::size_t open(int track, std::string name, stream_view s);
  void close(std::size_t span, stream_view s);
  /// A span measured on the host. Thread-safe.
  void host_span(int track, std::string name, clock::time_point begin, clock::time_point end);
  /// A counter's value from now on.
  void counter(const std::string& name, double value);

  /// Waits for the recorded events and writes the JSON.
  void write(const std::filesystem::path& file);

 private:
  static constexpr std::size_t dropped = static_cast<std::size_t>(-1);
  struct device_span_record {
    int track;
    std::string name;
    event begin;
    event end;
  };
  struct host_span_record {
    int track;
    std::string name;
    clock::time_point begin;
    clock::time_point end;
  };
  struct counter_record {
    std::string name;
    clock::time_point at;
    double value;
  };

  device device_;
  event origin_;
  clock::time_point origin_time_;
  std::vector<std::string> tracks_;
  std::vector<device_span_record> device_spans_;
  std::mutex host_mutex_;  // host spans come from the optimizer stream's thread
  std::vector<host_span_record> host_spans_;
  std::vector<counter_record> counters_;
  std::size_t dropped_ = 0;
};

/// The runtime's trace ([runtime] trace): its recorder, and its tracks, one per copy stream, one
/// for the host optimizer, and one per compute stream, in the order the streams are first seen.
struct runtime_trace {
  std::optional<trace_recorder> recorder;  // none without a trace
  int h2d = 0;
  int d2h = 0;
  int host = 0;
  std::unordered_map<void*, int> compute;
};

}  // namespace taskswap::detail
