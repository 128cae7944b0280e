// SPDX-License-Identifier: Apache-2.0
// A checkpoint's manifest (include/taskswap/checkpoint.hpp): its reader, every key known and every
// type and range checked, and its text. The files are checkpoint.cpp's.

#include "storage/checkpoint.hpp"

#include "device/message.hpp"

#include <taskswap/error.hpp>

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <tuple>

namespace taskswap {
namespace {

using detail::checkpoint_format;
using detail::manifest_file;
using detail::message;

// Whether a key of the trainer's entries is printable text: TOML's writer leaves some control
// characters (a trailing tab) outside the key's quotes, and the key would read back otherwise.
bool printable_key(std::string_view key)
{
  return std::none_of(key.begin(), key.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) == 0x7f;
  });
}

constexpr std::uintmax_t max_manifest_bytes = std::uintmax_t{256} << 20U;  // 2 MiB per 10,000 units: room to spare

std::string hex_float(double v)
{
  char buf[64];
  const bool negative = std::signbit(v);
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::hex);
  return std::string(negative ? "-0x" : "0x") + std::string(buf, ec == std::errc{} ? end : buf);
}

std::optional<double> parse_hex_float(std::string_view text)
{
  const bool negative = !text.empty() && text.front() == '-';
  if (negative) { text.remove_prefix(1); }
  if (text.size() < 3 || text.substr(0, 2) != "0x") { return std::nullopt; }
  text.remove_prefix(2);
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v, std::chars_format::hex);
  if (ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(v)) { return std::nullopt; }
  return negative ? -v : v;
}

// ---- the manifest's reader: every key known, every type and range checked ------------------

class reader {
 public:
  reader(const toml::table& t, std::string_view source, std::string where)
      : t_(t), source_(source), where_(std::move(where))
  {}

  [[noreturn]] void fail(const toml::node* n, std::string_view what) const
  {
    throw checkpoint_error(
      message(source_, ":", n != nullptr ? n->source().begin.line : t_.source().begin.line, ": ", where_, what));
  }

  const toml::node& need(std::string_view key)
  {
    used_.emplace_back(key);
    const toml::node* n = t_.get(key);
    if (n == nullptr) { fail(nullptr, message(" has no '", key, "'")); }
    return *n;
  }
  const toml::node* maybe(std::string_view key)
  {
    used_.emplace_back(key);
    return t_.get(key);
  }

  std::int64_t integer(std::string_view key, std::int64_t least, std::int64_t most)
  {
    const toml::node& n = need(key);
    const auto v = n.value_exact<std::int64_t>();
    if (!v || *v < least || *v > most) {
      fail(&n, message(" ", key, ": give an integer in [", least, ", ", most, "]"));
    }
    return *v;
  }
  std::string string(std::string_view key)
  {
    const toml::node& n = need(key);
    const auto v = n.value_exact<std::string>();
    if (!v) { fail(&n, message(" ", key, ": give a string")); }
    return *v;
  }
  double hex_double(std::string_view key)
  {
    const toml::node& n = need(key);
    const auto v = n.value_exact<std::string>();
    if (v) {
      if (const auto d = parse_hex_float(*v)) { return *d; }
    }
    fail(&n, message(" ", key, ": give a finite number as a hex float string, e.g. '0x1p-10' (as written)"));
  }
  const toml::table& table(std::string_view key)
  {
    const toml::node& n = need(key);
    const toml::table* t = n.as_table();
    if (t == nullptr) { fail(&n, message(" ", key, ": give a table")); }
    return *t;
  }
  const toml::array& array(std::string_view key)
  {
    const toml::node& n = need(key);
    const toml::array* a = n.as_array();
    if (a == nullptr) { fail(&n, message(" ", key, ": give an array")); }
    return *a;
  }
  void reject_unknown() const
  {
    for (const auto& [key, node] : t_) {
      if (std::find(used_.begin(), used_.end(), key.str()) == used_.end()) {
        fail(&node, message(" has an unknown key '", key.str(), "'"));
      }
    }
  }
  [[nodiscard]] std::string_view source() const noexcept { return source_; }
  [[nodiscard]] const std::string& where() const noexcept { return where_; }

 private:
  const toml::table& t_;
  std::string_view source_;
  std::string where_;
  std::vector<std::string> used_;
};

constexpr std::int64_t max_bytes = std::int64_t{1} << 50;  // 1 PiB: far beyond any host

dtype read_dtype(reader& r, std::string_view key)
{
  const std::string s = r.string(key);
  if (s == "f32") { return dtype::f32; }
  if (s == "bf16") { return dtype::bf16; }
  if (s == "f16") { return dtype::f16; }
  if (s == "u8") { return dtype::u8; }
  r.fail(nullptr, message(" ", key, ": \"", s, "\" is not f32, bf16, f16 or u8"));
}

checkpoint_slab read_slab(reader& parent, std::string_view key)
{
  reader r(parent.table(key), parent.source(), parent.where() + " " + std::string(key));
  checkpoint_slab s;
  s.offset = static_cast<std::uint64_t>(r.integer("offset", 0, max_bytes));
  s.bytes = static_cast<std::uint64_t>(r.integer("bytes", 0, max_bytes));
  s.crc32c = static_cast<std::uint32_t>(r.integer("crc32c", 0, 0xffffffffLL));
  r.reject_unknown();
  return s;
}

checkpoint_unit read_unit(const toml::node& node, std::string_view source, std::size_t index, std::int64_t version)
{
  const toml::table* t = node.as_table();
  if (t == nullptr) {
    throw checkpoint_error(message(source, ":", node.source().begin.line, ": units[", index, "] is not a table"));
  }
  checkpoint_unit u;
  {
    reader first(*t, source, message("units[", index, "]"));
    u.name = first.string("name");
  }
  reader r(*t, source, message("unit '", u.name, "'"));
  (void)r.string("name");
  u.compute = read_dtype(r, "compute");
  u.step = r.integer("step", 0, std::int64_t{1} << 62);
  const toml::array& tensors = r.array("tensors");
  for (const toml::node& tn : tensors) {
    const toml::table* tt = tn.as_table();
    if (tt == nullptr) { r.fail(&tn, " tensors: each tensor is a table { name, shape }"); }
    reader tr(*tt, source, message("unit '", u.name, "' tensor"));
    std::string name = tr.string("name");
    std::vector<std::size_t> shape;
    std::uint64_t count = 1;
    for (const toml::node& dn : tr.array("shape")) {
      const auto d = dn.value_exact<std::int64_t>();
      if (!d || *d < 1 || *d > max_bytes) {
        tr.fail(&dn, message(" '", name, "' shape: give dimensions of at least 1"));
      }
      if (static_cast<std::uint64_t>(*d) > static_cast<std::uint64_t>(max_bytes) / count) {
        tr.fail(&dn, message(" '", name, "' shape: too many elements"));
      }
      count *= static_cast<std::uint64_t>(*d);
      shape.push_back(static_cast<std::size_t>(*d));
    }
    if (shape.empty()) { tr.fail(tt, message(" '", name, "' shape: give at least one dimension")); }
    tr.reject_unknown();
    u.tensors.emplace_back(std::move(name), std::move(shape));
  }
  if (u.tensors.empty()) { r.fail(&tensors, " tensors: a unit has at least one tensor"); }
  u.params = read_slab(r, "params");
  if (const toml::node* trainable = r.maybe("trainable")) {
    const std::optional<bool> b = trainable->value_exact<bool>();
    if (!b) { r.fail(trainable, " trainable: give true or false"); }
    u.trainable = *b;
  }
  if (r.maybe("master") != nullptr) { u.master = read_slab(r, "master"); }
  if (u.master.has_value() != (u.compute != dtype::f32 && u.trainable)) {
    r.fail(nullptr, u.compute == dtype::f32 ? " has a master slab, which f32 units do not"
                    : u.trainable           ? " has no master slab, which trainable non-f32 units need"
                                            : " has a master slab, which units never trained do not");
  }
  u.m = read_slab(r, "m");
  u.v = read_slab(r, "v");
  if (const toml::node* file = r.maybe("file")) {
    if (version < 2) { r.fail(file, " file: version 1 checkpoints have no unit files; this one is damaged"); }
    u.file = r.string("file");
    // A name inside units/, never a path: a manifest cannot point a load elsewhere.
    if (u.file.empty() || u.file == "." || u.file == ".." || u.file.find('/') != std::string::npos ||
        u.file.find('\0') != std::string::npos) {
      r.fail(file, " file: give the name of a file in units/ (no '/')");
    }
  }
  r.reject_unknown();
  return u;
}

// Every slab of data.bin inside it; no slab overlapping another in the same file.
void check_slabs(const checkpoint_manifest& m, std::string_view source)
{
  struct extent {
    std::string_view file;  // empty: data.bin
    std::uint64_t offset;
    std::uint64_t end;
    std::string what;
  };
  std::vector<extent> all;
  for (const checkpoint_unit& u : m.units) {
    const auto add = [&](const checkpoint_slab& s, std::string_view what) {
      if (u.file.empty() && s.offset + s.bytes > m.data_bytes) {
        throw checkpoint_error(message(source, ": unit '", u.name, "' slab ", what, " (", s.bytes, " bytes at ",
                                       s.offset, ") reaches beyond data.bin's ", m.data_bytes, " bytes"));
      }
      all.push_back({u.file, s.offset, s.offset + s.bytes, message("unit '", u.name, "' slab ", what)});
    };
    add(u.params, "params");
    if (u.master) { add(*u.master, "master"); }
    add(u.m, "m");
    add(u.v, "v");
  }
  std::sort(all.begin(), all.end(),
            [](const extent& a, const extent& b) { return std::tie(a.file, a.offset) < std::tie(b.file, b.offset); });
  for (std::size_t i = 1; i < all.size(); ++i) {
    if (all[i].file == all[i - 1].file && all[i].offset < all[i - 1].end) {
      throw checkpoint_error(message(source, ": ", all[i].what, " overlaps ", all[i - 1].what));
    }
  }
}

}  // namespace

checkpoint_manifest parse_checkpoint_manifest(std::string_view text, std::string_view source)
{
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw checkpoint_error(message(source, ":", e.source().begin.line, ": ", e.description()));
  }
  reader r(root, source, "the manifest");
  if (r.string("format") != checkpoint_format) {
    r.fail(root.get("format"), message(" format: not \"", checkpoint_format, "\"; this is not a taskswap checkpoint"));
  }
  const std::int64_t version = r.integer("version", 1, 1'000'000);
  if (version > checkpoint_manifest::format_version) {
    r.fail(root.get("version"), message(" version ", version, ": this taskswap reads versions 1 to ",
                                        checkpoint_manifest::format_version, "; load it with a newer taskswap"));
  }
  checkpoint_manifest m;
  m.taskswap_version = r.string("taskswap");
  m.steps_done = static_cast<std::uint64_t>(r.integer("steps_done", 0, std::int64_t{1} << 62));
  m.world = static_cast<int>(r.integer("world", 1, 1 << 24));
  m.data_bytes = static_cast<std::uint64_t>(r.integer("data_bytes", 0, max_bytes));
  {
    reader o(r.table("optimizer"), source, "[optimizer]");
    m.optimizer.lr = o.hex_double("lr");
    m.optimizer.beta1 = o.hex_double("beta1");
    m.optimizer.beta2 = o.hex_double("beta2");
    m.optimizer.eps = o.hex_double("eps");
    m.optimizer.weight_decay = o.hex_double("weight_decay");
    if (o.maybe("clip") != nullptr) { m.optimizer.clip = o.hex_double("clip"); }  // absent before clipping existed
    if (!(m.optimizer.clip >= 0)) { o.fail(o.maybe("clip"), " clip: give 0 or more"); }
    o.reject_unknown();
  }
  if (r.maybe("scaler") != nullptr) {
    reader sc(r.table("scaler"), source, "[scaler]");
    const double scale = sc.hex_double("scale");
    if (!(scale > 0 && scale <= 3.0e38)) { sc.fail(sc.maybe("scale"), " scale: give a positive float"); }
    m.scaler = checkpoint_scaler{scale, sc.integer("growth_tracker", 0, std::int64_t{1} << 40)};
    sc.reject_unknown();
  }
  if (const toml::node* user = r.maybe("user")) {
    const toml::table* t = user->as_table();
    if (t == nullptr) { r.fail(user, " user: give a table of strings"); }
    for (const auto& [key, value] : *t) {
      const auto v = value.value_exact<std::string>();
      if (!v) { r.fail(&value, message(" user.", key.str(), ": give a string")); }
      if (!printable_key(key.str())) {
        r.fail(&value, " user: a key holds a control character; keys are printable text");
      }
      m.user.emplace(std::string(key.str()), *v);
    }
  }
  std::size_t index = 0;
  for (const toml::node& n : r.array("units")) { m.units.push_back(read_unit(n, source, index++, version)); }
  r.reject_unknown();
  std::vector<std::string_view> names;
  for (const checkpoint_unit& u : m.units) { names.push_back(u.name); }
  std::sort(names.begin(), names.end());
  if (const auto dup = std::adjacent_find(names.begin(), names.end()); dup != names.end()) {
    throw checkpoint_error(message(source, ": unit '", *dup, "' appears twice"));
  }
  check_slabs(m, source);
  return m;
}

checkpoint_manifest read_checkpoint_manifest(const std::filesystem::path& dir)
{
  const std::filesystem::path file = dir / manifest_file;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw checkpoint_error(
      message("there is no checkpoint at '", dir.string(), "' (no such directory); check the path"));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    throw checkpoint_error(message("'", dir.string(), "' is not a complete checkpoint: it has no readable ",
                                   manifest_file, " (a save that did not finish leaves none); use another checkpoint"));
  }
  const auto size = std::filesystem::file_size(file, ec);
  if (ec || size > max_manifest_bytes) {
    throw checkpoint_error(message(file.string(), " is ", ec ? std::string("unreadable") : detail::bytes_text(size),
                                   "; a manifest is at most ", detail::bytes_text(max_manifest_bytes),
                                   ": this is not a taskswap checkpoint"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse_checkpoint_manifest(text.str(), file.string());
}

namespace detail {

std::string manifest_text(const checkpoint_manifest& m)
{
  const auto slab = [](const checkpoint_slab& s) {
    return toml::table{{"offset", static_cast<std::int64_t>(s.offset)},
                       {"bytes", static_cast<std::int64_t>(s.bytes)},
                       {"crc32c", static_cast<std::int64_t>(s.crc32c)}};
  };
  toml::array units;
  for (const checkpoint_unit& u : m.units) {
    toml::array tensors;
    for (const auto& [name, shape] : u.tensors) {
      toml::array dims;
      for (std::size_t d : shape) { dims.push_back(static_cast<std::int64_t>(d)); }
      tensors.push_back(toml::table{{"name", name}, {"shape", dims}});
    }
    toml::table t{{"name", u.name},
                  {"compute", std::string(to_string(u.compute))},
                  {"step", u.step},
                  {"tensors", tensors},
                  {"params", slab(u.params)},
                  {"m", slab(u.m)},
                  {"v", slab(u.v)}};
    if (u.master) { t.insert("master", slab(*u.master)); }
    if (!u.trainable) { t.insert("trainable", false); }  // absent: trainable (as before units could be frozen)
    if (!u.file.empty()) { t.insert("file", u.file); }
    units.push_back(std::move(t));
  }
  toml::table user;
  for (const auto& [k, v] : m.user) {
    if (!printable_key(k)) {
      throw checkpoint_error(message("checkpoint: the trainer's entry key '", k,
                                     "' holds a control character; give keys of printable text"));
    }
    user.insert(k, v);
  }
  const bool own_files =
    std::any_of(m.units.begin(), m.units.end(), [](const checkpoint_unit& u) { return !u.file.empty(); });
  toml::table root{{"format", std::string(checkpoint_format)},
                   {"version", own_files ? checkpoint_manifest::format_version : std::int64_t{1}},
                   {"taskswap", m.taskswap_version},
                   {"steps_done", static_cast<std::int64_t>(m.steps_done)},
                   {"world", static_cast<std::int64_t>(m.world)},
                   {"data_bytes", static_cast<std::int64_t>(m.data_bytes)},
                   {"optimizer", toml::table{{"lr", hex_float(m.optimizer.lr)},
                                             {"beta1", hex_float(m.optimizer.beta1)},
                                             {"beta2", hex_float(m.optimizer.beta2)},
                                             {"eps", hex_float(m.optimizer.eps)},
                                             {"weight_decay", hex_float(m.optimizer.weight_decay)},
                                             {"clip", hex_float(m.optimizer.clip)}}},
                   {"user", user},
                   {"units", units}};
  if (m.scaler) {
    root.insert("scaler",
                toml::table{{"scale", hex_float(m.scaler->scale)}, {"growth_tracker", m.scaler->growth_tracker}});
  }
  std::ostringstream out;
  out << "# taskswap checkpoint manifest: slab offsets and sizes are bytes in data.bin, or in units/<file> for a\n"
      << "# unit with a file; crc32c is CRC-32C.\n"
      << root << "\n";
  return out.str();
}

// Copies the file `from` to the new file `to` and flushes it: a clone where the file system shares

}  // namespace detail
}  // namespace taskswap
