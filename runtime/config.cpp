// SPDX-License-Identifier: Apache-2.0
// The TOML configuration of DESIGN.md, read with toml++. Every error names the file, the line and
// the key, and says what to write instead.

#include <taskswap/config.hpp>

#include "device/message.hpp"
#include "runtime/homes/home_tier.hpp"
#include "host/cpu_adamw.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

namespace taskswap {

namespace {

using detail::message;

struct unit_suffix {
  std::string_view name;
  double scale;
};

// "<number> <unit>" with optional blanks between; the unit is required.
std::optional<double> scaled_number(std::string_view text, std::span<const unit_suffix> units)
{
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])) != 0) { ++i; }
  std::size_t j = i;
  while (j < text.size() && (std::isdigit(static_cast<unsigned char>(text[j])) != 0 || text[j] == '.' ||
                             text[j] == 'e' || text[j] == 'E' || text[j] == '+' || text[j] == '-')) {
    ++j;
  }
  if (j == i) { return std::nullopt; }
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data() + i, text.data() + j, value);
  if (ec != std::errc{} || end != text.data() + j || !std::isfinite(value) || value < 0) { return std::nullopt; }
  std::size_t k = j;
  while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k])) != 0) { ++k; }
  std::size_t e = text.size();
  while (e > k && std::isspace(static_cast<unsigned char>(text[e - 1])) != 0) { --e; }
  const std::string_view suffix = text.substr(k, e - k);
  for (const unit_suffix& u : units) {
    if (suffix == u.name) { return value * u.scale; }
  }
  return std::nullopt;
}

constexpr std::array size_units{
  unit_suffix{"B", 1.0},
  unit_suffix{"KiB", 1024.0},
  unit_suffix{"MiB", 1048576.0},
  unit_suffix{"GiB", 1073741824.0},
  unit_suffix{"TiB", 1099511627776.0},
  unit_suffix{"KB", 1e3},
  unit_suffix{"MB", 1e6},
  unit_suffix{"GB", 1e9},
  unit_suffix{"TB", 1e12},
};
constexpr std::array rate_units{
  unit_suffix{"B/s", 1.0},
  unit_suffix{"KB/s", 1e3},
  unit_suffix{"MB/s", 1e6},
  unit_suffix{"GB/s", 1e9},
  unit_suffix{"KiB/s", 1024.0},
  unit_suffix{"MiB/s", 1048576.0},
  unit_suffix{"GiB/s", 1073741824.0},
};
constexpr std::array time_units{
  unit_suffix{"ns", 1e-9}, unit_suffix{"us", 1e-6},  unit_suffix{"ms", 1e-3},
  unit_suffix{"s", 1.0},   unit_suffix{"min", 60.0},
};

// Reads one table of the file; remembers the keys it used, so the rest can be reported unknown.
class table_reader {
 public:
  table_reader(const toml::table& table, std::string_view source, std::string section)
      : table_(table), source_(source), section_(std::move(section))
  {}

  [[noreturn]] void fail(const toml::node& at, std::string_view key, std::string_view problem) const
  {
    throw config_error(message(source_, ":", at.source().begin.line, ": ", section_, " ", key, ": ", problem));
  }

  const toml::node* get(std::string_view key)
  {
    used_.emplace_back(key);
    return table_.get(key);
  }

  std::optional<std::string> string(std::string_view key)
  {
    const toml::node* n = get(key);
    if (n == nullptr) { return std::nullopt; }
    if (!n->is_string()) { fail(*n, key, message("expected a string, found ", type_name(*n))); }
    return n->as_string()->get();
  }

  std::optional<std::int64_t> integer(std::string_view key, std::int64_t min, std::int64_t max)
  {
    const toml::node* n = get(key);
    if (n == nullptr) { return std::nullopt; }
    if (!n->is_integer()) { fail(*n, key, message("expected an integer, found ", type_name(*n))); }
    const std::int64_t v = n->as_integer()->get();
    if (v < min || v > max) { fail(*n, key, message(v, " is out of range; use ", min, " to ", max)); }
    return v;
  }

  std::optional<double> number(std::string_view key)
  {
    const toml::node* n = get(key);
    if (n == nullptr) { return std::nullopt; }
    return number_of(*n, key);
  }

  double number_of(const toml::node& n, std::string_view key) const
  {
    if (n.is_floating_point()) { return n.as_floating_point()->get(); }
    if (n.is_integer()) { return static_cast<double>(n.as_integer()->get()); }
    fail(n, key, message("expected a number, found ", type_name(n)));
  }

  std::optional<bool> boolean(std::string_view key)
  {
    const toml::node* n = get(key);
    if (n == nullptr) { return std::nullopt; }
    if (!n->is_boolean()) { fail(*n, key, message("expected true or false, found ", type_name(*n))); }
    return n->as_boolean()->get();
  }

  enum class positive : bool { no, yes };

  template <std::size_t N>
  std::optional<double> quantity(std::string_view key, const std::array<unit_suffix, N>& units,
                                 std::string_view example, positive must_be_positive = positive::no)
  {
    const toml::node* n = get(key);
    if (n == nullptr) { return std::nullopt; }
    if (!n->is_string()) {
      fail(*n, key,
           message("expected a quantity with a unit as a string, e.g. \"", example, "\"; found ", type_name(*n)));
    }
    const std::string& text = n->as_string()->get();
    const auto v = scaled_number(text, units);
    if (!v) { fail(*n, key, message("\"", text, "\" is not a quantity with a unit; write e.g. \"", example, "\"")); }
    // Every quantity becomes a 64-bit count (bytes, bytes per second, milliseconds): 1e18 is far
    // beyond any real one and keeps the conversions defined (found by the config fuzzer).
    if (*v > 1e18) { fail(*n, key, message("\"", text, "\" is too large; write e.g. \"", example, "\"")); }
    if (must_be_positive == positive::yes && *v <= 0) {
      fail(*n, key,
           message("\"", text, "\" must be more than zero; write e.g. \"", example,
                   "\", or leave the key out for no limit"));
    }
    return v;
  }

  template <typename Enum, std::size_t N>
  std::optional<Enum> choice(std::string_view key, const std::array<std::pair<std::string_view, Enum>, N>& names)
  {
    const auto text = string(key);
    if (!text) { return std::nullopt; }
    std::string allowed;
    for (const auto& [name, value] : names) {
      if (*text == name) { return value; }
      allowed += (allowed.empty() ? "" : " | ") + std::string(name);
    }
    fail(*table_.get(key), key, message("unknown value \"", *text, "\"; use ", allowed));
  }

  /// Reports the first key no getter asked for.
  void reject_unknown() const
  {
    for (const auto& [key, node] : table_) {
      if (std::find(used_.begin(), used_.end(), key.str()) == used_.end()) {
        throw config_error(message(source_, ":", key.source().begin.line, ": ", section_, " has no key '", key.str(),
                                   "'; check its spelling in docs/configuration.md"));
      }
    }
  }

  static std::string_view type_name(const toml::node& n)
  {
    switch (n.type()) {
      case toml::node_type::table: return "a table";
      case toml::node_type::array: return "an array";
      case toml::node_type::string: return "a string";
      case toml::node_type::integer: return "an integer";
      case toml::node_type::floating_point: return "a floating-point number";
      case toml::node_type::boolean: return "a boolean";
      default: return "a date or time";
    }
  }

 private:
  const toml::table& table_;
  std::string_view source_;
  std::string section_;
  std::vector<std::string> used_;
};

constexpr std::array residency_names{std::pair{std::string_view("pinned"), residency::pinned},
                                     std::pair{std::string_view("prefetch"), residency::prefetch},
                                     std::pair{std::string_view("on_demand"), residency::on_demand}};
constexpr std::array placement_names{std::pair{std::string_view("device"), optimizer_placement::device},
                                     std::pair{std::string_view("host"), optimizer_placement::host}};

const toml::table* section(const toml::table& root, std::string_view name, std::string_view source)
{
  const toml::node* n = root.get(name);
  if (n == nullptr) { return nullptr; }
  if (!n->is_table()) {
    throw config_error(message(source, ":", n->source().begin.line, ": [", name, "] must be a table"));
  }
  return n->as_table();
}

// [device.vm_costs]: each call's host time on the emulated device, over the profile's.
void read_vm_costs(const toml::table& t, std::string_view source, vm_cost_model& c)
{
  table_reader r(t, source, "[device.vm_costs]");
  using entry = std::pair<std::string_view, vm_call_cost*>;
  for (const auto& [name, cost] : {entry{"map", &c.map}, entry{"access", &c.access}, entry{"unmap", &c.unmap},
                                   entry{"create", &c.create}, entry{"release", &c.release}}) {
    if (auto v = r.quantity(name, time_units, "33 us")) { cost->per_call_seconds = *v; }
    if (auto v = r.quantity(std::string(name) + "_per_mib", time_units, "0.5 us")) { cost->per_mib_seconds = *v; }
  }
  if (auto f = r.number("busy_factor")) {
    if (*f < 1.0) { r.fail(*t.get("busy_factor"), "busy_factor", message(*f, " is below 1; write e.g. 2.0")); }
    c.busy_factor = *f;
  }
  r.reject_unknown();
}

void read_device(const toml::table& t, std::string_view source, device_options& d)
{
  table_reader r(t, source, "[device]");
  constexpr std::array backends{std::pair{std::string_view("cuda"), backend_kind::cuda},
                                std::pair{std::string_view("emulated"), backend_kind::emulated}};
  if (auto b = r.choice("backend", backends)) { d.backend = *b; }
  if (auto i = r.integer("index", 0, 1023)) { d.index = static_cast<int>(*i); }
  if (auto b = r.quantity("budget", size_units, "40 GiB")) { d.budget = static_cast<std::size_t>(*b); }
  // The profile first: the keys below override its figures.
  constexpr std::array profiles{std::pair{std::string_view("h200"), std::string_view("h200")}};
  if (auto p = r.choice("profile", profiles)) { d.emulated = emulated_profile(*p, d.emulated); }
  if (auto s = r.number("time_scale")) {
    if (*s <= 0) { r.fail(*t.get("time_scale"), "time_scale", message(*s, " must be more than 0; write e.g. 10")); }
    d.emulated.time_scale = *s;
  }
  if (const toml::node* v = r.get("vm_costs")) {
    if (!v->is_table()) { r.fail(*v, "vm_costs", "must be a table ([device.vm_costs])"); }
    read_vm_costs(*v->as_table(), source, d.emulated.vm_costs);
  }
  if (auto m = r.quantity("memory", size_units, "80 GiB")) { d.emulated.memory_bytes = static_cast<std::size_t>(*m); }
  if (auto l = r.quantity("link_bandwidth", rate_units, "25 GB/s", table_reader::positive::yes)) {
    d.emulated.link.bytes_per_second = *l;
  }
  if (auto l = r.quantity("link_latency", time_units, "10 us")) { d.emulated.link.latency_seconds = *l; }
  if (auto g = r.quantity("granularity", size_units, "2 MiB", table_reader::positive::yes)) {
    const auto bytes = static_cast<std::size_t>(*g);
    if (bytes < 256 || (bytes & (bytes - 1)) != 0 || static_cast<double>(bytes) != *g) {
      r.fail(*t.get("granularity"), "granularity",
             message(detail::bytes_text(bytes), " is not a power of two of at least 256 bytes"));
    }
    d.emulated.granularity = bytes;
  }
  r.reject_unknown();
}

void read_host(const toml::table& t, std::string_view source, host_options& h)
{
  table_reader r(t, source, "[host]");
  if (auto n = r.integer("numa_node", -1, 4095)) { h.numa_node = static_cast<int>(*n); }
  if (auto b = r.boolean("huge_pages")) { h.huge_pages = *b; }
  if (auto n = r.integer("optimizer_threads", 0, 4096)) { h.optimizer_threads = static_cast<int>(*n); }
  r.reject_unknown();
}

void read_storage(const toml::table& t, std::string_view source, storage_options& st)
{
  table_reader r(t, source, "[storage]");
  if (auto p = r.string("path")) {
    if (p->empty()) { r.fail(*r.get("path"), "path", "must name a directory on a local drive"); }
    st.path = *p;
  }
  if (auto b = r.quantity("host_cache", size_units, "64 GiB", table_reader::positive::yes)) {
    st.host_cache = static_cast<std::size_t>(*b);
  }
  if (auto n = r.integer("queue_depth", 1, 4096)) { st.queue_depth = static_cast<unsigned>(*n); }
  if (auto n = r.integer("lookahead", 0, 1 << 20)) { st.lookahead = static_cast<int>(*n); }
  if (auto b = r.quantity("block", size_units, "1 MiB", table_reader::positive::yes)) {
    const auto bytes = static_cast<std::size_t>(*b);
    if (bytes % 4096 != 0 || bytes > (std::size_t{1} << 30)) {
      r.fail(*r.get("block"), "block", "must be a multiple of 4 KiB of at most 1 GiB, e.g. block = \"1 MiB\"");
    }
    st.block = bytes;
  }
  if (auto s = r.quantity("timeout", time_units, "300 s", table_reader::positive::yes)) {
    if (*s < 0.001 || *s > 365.0 * 86400) {
      r.fail(*r.get("timeout"), "timeout", "must be 1 ms to a year, e.g. timeout = \"300 s\"");
    }
    st.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(*s * 1000.0)));
  }
  r.reject_unknown();
}

template <typename Policy>
void read_policy(table_reader& r, Policy& p)
{
  if (auto v = r.choice("residency", residency_names)) { p.residency = *v; }
  if (auto v = r.integer("lookahead", 0, 1 << 20)) { p.lookahead = static_cast<int>(*v); }
  if (auto v = r.choice("optimizer", placement_names)) { p.optimizer = *v; }
  // Param groups: a unit's learning rate relative to [optimizer] lr, and its own weight decay.
  if (auto v = r.number("lr_scale")) {
    if (!(*v > 0 && std::isfinite(*v))) {
      r.fail(*r.get("lr_scale"), "lr_scale", "must be more than 0, e.g. lr_scale = 10.0");
    }
    p.lr_scale = *v;
  }
  if (auto v = r.number("weight_decay")) {
    if (!(*v >= 0 && std::isfinite(*v))) { r.fail(*r.get("weight_decay"), "weight_decay", "must be 0 or more"); }
    p.weight_decay = *v;
  }
  if (auto v = r.string("home")) {  // a home tier (Note [Home tiers])
    try {
      (void)detail::home_tier_named(*v);
    } catch (const config_error&) {
      r.fail(*r.get("home"), "home",
             message("\"", *v, "\" is not a home tier; the tiers are ", detail::home_tier_names()));
    }
    p.home = *v;
  }
}

void read_units(const toml::node& n, std::string_view source, std::vector<unit_rule>& rules)
{
  if (!n.is_array_of_tables()) {
    throw config_error(
      message(source, ":", n.source().begin.line, ": units must be an array of tables, written [[units]]"));
  }
  for (const toml::node& e : *n.as_array()) {
    const toml::table& t = *e.as_table();
    table_reader r(t, source, "[[units]]");
    unit_rule rule;
    const auto match = r.string("match");
    if (!match || match->empty()) {
      throw config_error(
        message(source, ":", t.source().begin.line, ": [[units]] needs match = \"<glob>\", e.g. match = \"task/*\""));
    }
    rule.match = *match;
    read_policy(r, rule);
    r.reject_unknown();
    rule.origin = message(source, ":", t.source().begin.line);
    rules.push_back(std::move(rule));
  }
}

void read_optimizer(const toml::table& t, std::string_view source, adamw_options& o)
{
  table_reader r(t, source, "[optimizer]");
  if (auto k = r.string("kind"); k && *k != "adamw") {
    r.fail(*t.get("kind"), "kind", message("unknown optimizer \"", *k, "\"; taskswap has adamw"));
  }
  if (auto v = r.number("lr")) { o.lr = *v; }
  if (auto v = r.number("eps")) { o.eps = *v; }
  if (auto v = r.number("weight_decay")) { o.weight_decay = *v; }
  if (auto v = r.number("clip")) { o.clip = *v; }
  if (const toml::node* b = r.get("betas")) {
    const toml::array* a = b->as_array();
    const toml::node* b1 = a != nullptr && a->size() == 2 ? a->get(0) : nullptr;
    const toml::node* b2 = a != nullptr && a->size() == 2 ? a->get(1) : nullptr;
    if (b1 == nullptr || b2 == nullptr) { r.fail(*b, "betas", "expected two numbers, e.g. betas = [0.9, 0.999]"); }
    o.beta1 = r.number_of(*b1, "betas");
    o.beta2 = r.number_of(*b2, "betas");
  }
  if (const auto problem = detail::adamw_problem(o)) {
    const toml::node* at = t.get(problem->key);
    r.fail(at != nullptr ? *at : static_cast<const toml::node&>(t), problem->key, problem->want);
  }
  r.reject_unknown();
}

void read_comm(const toml::table& t, std::string_view source, comm_options& c)
{
  table_reader r(t, source, "[comm]");
  constexpr std::array backends{std::pair{std::string_view("nccl"), comm_backend::nccl},
                                std::pair{std::string_view("mpi"), comm_backend::mpi},
                                std::pair{std::string_view("none"), comm_backend::none}};
  constexpr std::array averages{std::pair{std::string_view("contributors"), average_mode::contributors},
                                std::pair{std::string_view("world"), average_mode::world}};
  if (auto b = r.choice("backend", backends)) { c.backend = *b; }
  if (auto b = r.quantity("bucket_cap", size_units, "25 MiB")) { c.bucket_cap = static_cast<std::size_t>(*b); }
  if (auto a = r.choice("average", averages)) { c.average = *a; }
  if (const toml::node* n = t.get("reduce"); n != nullptr && n->value<std::string>() == "all") {
    r.fail(*n, "reduce",
           "\"all\" is now \"every_unit\": it updates every unit every step, also units no rank trained "
           "(which DDP leaves alone). For DDP's numerics keep reduce = \"active\" with average = \"world\"; "
           "for DDP's byte count use \"every_unit\"");
  }
  constexpr std::array reduces{std::pair{std::string_view("active"), false},
                               std::pair{std::string_view("every_unit"), true}};
  if (auto a = r.choice("reduce", reduces)) { c.reduce_every_unit = *a; }
  constexpr std::array initials{std::pair{std::string_view("broadcast"), initial_sync::broadcast},
                                std::pair{std::string_view("verify"), initial_sync::verify}};
  if (auto i = r.choice("initial", initials)) { c.initial = *i; }
  if (auto s = r.quantity("timeout", time_units, "300 s")) {
    c.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(*s * 1000.0)));
  }
  r.reject_unknown();
}

void read_scaler(const toml::table& t, std::string_view source, loss_scaler_options& s)
{
  table_reader r(t, source, "[scaler]");
  if (auto b = r.boolean("enabled")) { s.enabled = *b; }
  if (auto v = r.number("init_scale")) {
    if (!(*v > 0 && *v <= 3.0e38)) {
      r.fail(*r.get("init_scale"), "init_scale", "must be a positive float, e.g. 65536.0");
    }
    s.init_scale = *v;
  }
  if (auto v = r.number("growth_factor")) {
    if (!(*v > 1)) { r.fail(*r.get("growth_factor"), "growth_factor", "must be more than 1, e.g. 2.0"); }
    s.growth_factor = *v;
  }
  if (auto v = r.number("backoff_factor")) {
    if (!(*v > 0 && *v < 1)) { r.fail(*r.get("backoff_factor"), "backoff_factor", "must be in (0, 1), e.g. 0.5"); }
    s.backoff_factor = *v;
  }
  if (auto n = r.integer("growth_interval", 1, 2'000'000'000)) { s.growth_interval = *n; }
  r.reject_unknown();
}

void read_runtime(const toml::table& t, std::string_view source, runtime_options& o)
{
  table_reader r(t, source, "[runtime]");
  if (auto b = r.boolean("measure_stall")) { o.measure_stall = *b; }
  if (auto b = r.boolean("trace")) { o.trace = *b; }
  if (auto d = r.quantity("timeout", time_units, "300 s")) {
    o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(*d * 1000.0)));
  }
  r.reject_unknown();
}

}  // namespace

std::size_t parse_size(std::string_view text)
{
  const auto v = scaled_number(text, size_units);
  if (!v || *v > 1.8e19) {
    throw config_error(message("\"", text, "\" is not a size with a unit; write e.g. \"40 GiB\" or \"512 MiB\""));
  }
  return static_cast<std::size_t>(*v);
}

runtime_options parse_config(std::string_view text, std::string_view source) { return parse_config(text, source, {}); }

runtime_options parse_config(std::string_view text, std::string_view source,
                             std::span<const std::string_view> own_tables)
{
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw config_error(message(source, ":", e.source().begin.line, ": ", e.description()));
  }
  runtime_options o;
  o.source = std::string(source);
  for (const auto& [key, node] : root) {
    const std::string_view k = key.str();
    if (k == "units") {
      read_units(node, source, o.units);
      continue;
    }
    if (std::find(own_tables.begin(), own_tables.end(), k) != own_tables.end()) { continue; }
    const toml::table* t = section(root, k, source);
    if (t == nullptr || (k != "device" && k != "host" && k != "storage" && k != "defaults" && k != "optimizer" &&
                         k != "comm" && k != "runtime" && k != "scaler")) {
      throw config_error(message(source, ":", key.source().begin.line, ": unknown key '", k,
                                 "'; the sections are [device], [host], [storage], [defaults], [[units]], [optimizer], "
                                 "[scaler], [comm], [runtime]"));
    }
    if (k == "device") { read_device(*t, source, o.device); }
    if (k == "host") { read_host(*t, source, o.host); }
    if (k == "storage") { read_storage(*t, source, o.storage); }
    if (k == "optimizer") { read_optimizer(*t, source, o.optimizer); }
    if (k == "comm") { read_comm(*t, source, o.comm); }
    if (k == "runtime") { read_runtime(*t, source, o); }
    if (k == "scaler") { read_scaler(*t, source, o.scaler); }
    if (k == "defaults") {
      table_reader r(*t, source, "[defaults]");
      read_policy(r, o.defaults);
      r.reject_unknown();
    }
  }
  if (o.device.budget == 0) {
    throw config_error(message(source, ": [device] budget is missing; give the device bytes taskswap may use, e.g. "
                                       "budget = \"40 GiB\""));
  }
  return o;
}

runtime_options load_config(const std::filesystem::path& file) { return load_config(file, {}); }

std::string read_config_file(const std::filesystem::path& file)
{
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(file, ec);
  if (st.type() == std::filesystem::file_type::not_found) {
    throw config_error(message("the configuration '", file.string(), "' does not exist; check the path"));
  }
  if (st.type() == std::filesystem::file_type::directory) {
    throw config_error(message("the configuration '", file.string(),
                               "' is a directory; give the path of a TOML file (e.g. samples/configs/emulated.toml)"));
  }
  if (!ec && st.type() != std::filesystem::file_type::regular) {
    throw config_error(message("the configuration '", file.string(),
                               "' is not a regular file (a FIFO, socket or device); give the path of a TOML file"));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    throw config_error(message("cannot read the configuration '", file.string(), "'",
                               ec ? message(" (", ec.message(), ")") : std::string(), "; check its permissions"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

runtime_options load_config(const std::filesystem::path& file, std::span<const std::string_view> own_tables)
{
  return parse_config(read_config_file(file), file.string(), own_tables);
}

device make_device(const device_options& options)
{
  if (options.backend == backend_kind::cuda) { return cuda_device(options.index); }
  emulated_options e = options.emulated;
  if (e.memory_bytes == 0) { e.memory_bytes = options.budget; }
  return emulated_device(e);
}

}  // namespace taskswap
