// SPDX-License-Identifier: Apache-2.0
// A checkpoint's files (include/taskswap/checkpoint.hpp): data.bin, the unit files' copies, the
// temporary directory and the rename into place, verification and loading. The manifest is
// checkpoint_manifest.cpp's.

#include "storage/checkpoint.hpp"

#include "device/log.hpp"
#include "device/message.hpp"
#include "storage/crc32c.hpp"
#include "storage/posix_file.hpp"

#include <taskswap/build_info.hpp>
#include <taskswap/error.hpp>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>  // NOLINT(modernize-deprecated-headers): renameat2
#include <linux/fs.h>  // FICLONE
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <tuple>

namespace taskswap {
namespace {

using detail::message;

constexpr std::string_view data_file = "data.bin";
constexpr std::string_view units_dir = "units";  // the disk homes' unit files
constexpr std::size_t io_chunk = std::size_t{8} << 20U;

std::string hex(std::uint32_t crc)
{
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIx32, crc);
  return buf;
}

// Hex floats, exact and independent of the locale: "0x" + to_chars(hex).
// ---- files ----------------------------------------------------------------------------------

std::string system_reason() { return detail::errno_reason(errno); }

// A file of a checkpoint: a posix_file whose failures are checkpoint_errors naming its path.
class checkpoint_file {
 public:
  checkpoint_file(const std::filesystem::path& path, int flags, mode_t mode = 0644) : f_(path, flags, mode)
  {
    if (!f_.is_open()) {
      throw checkpoint_error(message("cannot open '", path.string(), "': ", detail::errno_reason(f_.error())));
    }
  }
  void write_all(std::span<const std::byte> data) const { check(f_.write_all(data), "writing"); }
  /// Reads exactly data.size() bytes at `offset`.
  void read_at(std::span<std::byte> data, std::uint64_t offset) const
  {
    const int e = f_.read_at(data, offset);
    if (e != 0) {
      throw checkpoint_error(message("reading '", path().string(), "' at ", offset, " failed: ",
                                     e == detail::posix_file::ended ? "it ends there" : detail::errno_reason(e)));
    }
  }
  /// Writes all of `data` at `offset`.
  void write_at(std::span<const std::byte> data, std::uint64_t offset) const
  {
    const int e = f_.write_at(data, offset);
    if (e != 0) {
      throw checkpoint_error(
        message("writing '", path().string(), "' at ", offset, " failed: ", detail::errno_reason(e)));
    }
  }
  void sync() const { check(f_.sync(), "flushing"); }
  [[nodiscard]] std::uint64_t size() const
  {
    struct stat st {};
    const int e = f_.status(st);
    if (e != 0) { throw checkpoint_error(message("cannot stat '", path().string(), "': ", detail::errno_reason(e))); }
    return static_cast<std::uint64_t>(st.st_size);
  }
  [[nodiscard]] bool regular() const
  {
    struct stat st {};
    return f_.status(st) == 0 && S_ISREG(st.st_mode);
  }
  void forget() const { f_.forget(); }
  [[nodiscard]] int fd() const noexcept { return f_.fd(); }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return f_.path(); }

 private:
  void check(int e, std::string_view doing) const
  {
    if (e != 0) {
      throw checkpoint_error(message(doing, " '", path().string(), "' failed: ", detail::errno_reason(e)));
    }
  }
  detail::posix_file f_;
};

void flush_directory(const std::filesystem::path& dir)
{
  const int e = detail::sync_directory(dir);
  if (e != 0) { throw checkpoint_error(message("flushing '", dir.string(), "' failed: ", detail::errno_reason(e))); }
}

std::uint32_t slab_crc(checkpoint_file& f, const checkpoint_slab& s, std::vector<std::byte>& buffer)
{
  std::uint32_t crc = 0;
  for (std::uint64_t done = 0; done < s.bytes;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(io_chunk, s.bytes - done));
    buffer.resize(n);
    f.read_at(buffer, s.offset + done);
    crc = detail::crc32c(buffer, crc);
    done += n;
  }
  return crc;
}

template <typename Fn>
void for_each_slab(const checkpoint_unit& u, Fn&& fn)
{
  fn(u.params, "params");
  if (u.master) { fn(*u.master, "master"); }
  fn(u.m, "m");
  fn(u.v, "v");
}

// The file holding a unit's slabs in the checkpoint `dir`.
std::filesystem::path slab_file(const std::filesystem::path& dir, const checkpoint_unit& u)
{
  return u.file.empty() ? dir / data_file : dir / units_dir / u.file;
}

// Opens a unit's file in a checkpoint for reading: a regular file, never through a link (a
// damaged manifest or directory cannot make a load read elsewhere, or block on a pipe).
checkpoint_file open_checkpoint_file(const std::filesystem::path& dir, const checkpoint_unit& u)
{
  const std::filesystem::path path = slab_file(dir, u);
  std::error_code ec;
  if (std::filesystem::is_symlink(dir / units_dir, ec) || std::filesystem::is_symlink(path, ec)) {
    throw checkpoint_error(message("checkpoint '", dir.string(), "': ", path.string(),
                                   " is a symbolic link; a checkpoint holds its files itself: use another one"));
  }
  checkpoint_file f(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
  if (!f.regular()) {
    throw checkpoint_error(
      message("checkpoint '", dir.string(), "': ", path.string(), " is not a regular file: use another checkpoint"));
  }
  return f;
}

// The largest end of a unit's slabs: its file is at least that long.
std::uint64_t slabs_end(const checkpoint_unit& u)
{
  std::uint64_t end = 0;
  for_each_slab(u, [&](const checkpoint_slab& s, std::string_view) { end = std::max(end, s.offset + s.bytes); });
  return end;
}

}  // namespace

void verify_checkpoint(const std::filesystem::path& dir) { detail::verify_data(dir, read_checkpoint_manifest(dir)); }

void detail::verify_data(const std::filesystem::path& dir, const checkpoint_manifest& m)
{
  checkpoint_file f(dir / data_file, O_RDONLY);
  const std::uint64_t size = f.size();
  if (size != m.data_bytes) {
    throw checkpoint_error(message("checkpoint '", dir.string(), "': ", data_file, " has ", size,
                                   " bytes but the manifest says ", m.data_bytes,
                                   ": it is incomplete or was changed; use another checkpoint"));
  }
  std::vector<std::byte> buffer;
  for (const checkpoint_unit& u : m.units) {
    std::optional<checkpoint_file> own;  // the unit's file in units/
    if (!u.file.empty()) {
      std::error_code ec;
      if (!std::filesystem::exists(slab_file(dir, u), ec)) {
        throw checkpoint_error(message("checkpoint '", dir.string(), "': unit '", u.name, "' has no file ", units_dir,
                                       "/", u.file, ": it is incomplete; use another checkpoint"));
      }
      own.emplace(open_checkpoint_file(dir, u));
      if (own->size() < slabs_end(u)) {
        throw checkpoint_error(message("checkpoint '", dir.string(), "': ", units_dir, "/", u.file, " has ",
                                       own->size(), " bytes but unit '", u.name, "' needs ", slabs_end(u),
                                       ": it is incomplete or was changed; use another checkpoint"));
      }
    }
    for_each_slab(u, [&](const checkpoint_slab& s, std::string_view what) {
      const std::uint32_t crc = slab_crc(own ? *own : f, s, buffer);
      if (crc != s.crc32c) {
        throw checkpoint_error(message("checkpoint '", dir.string(), "': unit '", u.name, "' slab ", what, " (",
                                       s.bytes, " bytes at ", s.offset, " in ", slab_file(dir, u).filename().string(),
                                       ") has CRC-32C ", hex(crc), " but the manifest says ", hex(s.crc32c),
                                       ": the checkpoint is corrupted; use another one"));
      }
    });
  }
}

namespace detail {

checkpoint_manifest describe_checkpoint(std::span<const checkpoint_source> units)
{
  checkpoint_manifest m;
  m.taskswap_version = build_features().version;
  std::uint64_t at = 0;  // in data.bin
  std::vector<std::byte> buffer;
  for (const checkpoint_source& u : units) {
    std::optional<checkpoint_file> file;  // a disk home: its slabs keep their places in its file
    if (!u.file.empty()) { file.emplace(u.file, O_RDONLY); }
    const auto slab = [&](const home_range& r) {
      if (file) {
        checkpoint_slab c{.offset = r.offset, .bytes = r.bytes};
        c.crc32c = slab_crc(*file, c, buffer);
        return c;
      }
      const checkpoint_slab c{.offset = at, .bytes = r.bytes, .crc32c = crc32c(u.home.subspan(r.offset, r.bytes))};
      at += r.bytes;
      return c;
    };
    checkpoint_unit c;
    c.name = u.name;
    c.compute = u.compute;
    c.tensors = u.tensors;
    c.step = u.step;
    c.params = slab(u.params);
    if (u.master.bytes != 0) { c.master = slab(u.master); }
    c.m = slab(u.m);
    c.v = slab(u.v);
    c.trainable = u.trainable;
    if (file) {
      c.file = u.file.filename().string();
      file->forget();
    }
    m.units.push_back(std::move(c));
  }
  m.data_bytes = at;
  return m;
}

// through a buffer. `first` skips the earlier ways (tests).
void copy_unit_file(const std::filesystem::path& from, const std::filesystem::path& to, file_copy first)
{
  checkpoint_file src(from, O_RDONLY);
  checkpoint_file dst(to, O_WRONLY | O_CREAT | O_EXCL);
  const auto unsupported = [](int e) {  // the call does not apply to these files: the next way then
    return e == EXDEV || e == EINVAL || e == ENOSYS || e == EOPNOTSUPP || e == ENOTTY || e == EPERM;
  };
  if (first != file_copy::clone || ::ioctl(dst.fd(), FICLONE, src.fd()) != 0) {
    if (first == file_copy::clone && !unsupported(errno)) {
      throw checkpoint_error(message("copying '", from.string(), "' to '", to.string(), "' failed: ", system_reason()));
    }
    const std::uint64_t size = src.size();
    std::uint64_t done = 0;
    while (first != file_copy::buffered && done < size) {
      const ssize_t n = ::copy_file_range(src.fd(), nullptr, dst.fd(), nullptr, size - done, 0);
      if (n < 0 && errno == EINTR) { continue; }
      if (done == 0 && (n == 0 || (n < 0 && unsupported(errno)))) {
        break;  // not between these files (0 at the start: some file systems say so): through a buffer below
      }
      if (n <= 0) {
        throw checkpoint_error(message("copying '", from.string(), "' to '", to.string(),
                                       "' failed: ", n == 0 ? "it ended early" : system_reason()));
      }
      done += static_cast<std::uint64_t>(n);
    }
    std::vector<std::byte> buffer;
    for (; done < size;) {
      buffer.resize(static_cast<std::size_t>(std::min<std::uint64_t>(io_chunk, size - done)));
      src.read_at(buffer, done);
      dst.write_at(buffer, done);
      done += buffer.size();
    }
  }
  dst.sync();
  src.forget();
  dst.forget();
}

namespace {

// Checks the copied unit files against the manifest's checksums (taken from the run's files)
// before the checkpoint is put in place.
void verify_copies(const std::filesystem::path& tmp, const checkpoint_manifest& manifest)
{
  std::vector<std::byte> buffer;
  for (const checkpoint_unit& u : manifest.units) {
    if (u.file.empty()) { continue; }
    checkpoint_file f(slab_file(tmp, u), O_RDONLY);
    for_each_slab(u, [&](const checkpoint_slab& sl, std::string_view what) {
      if (slab_crc(f, sl, buffer) != sl.crc32c) {
        throw checkpoint_error(
          message("the copy of unit '", u.name, "' (", f.path().string(), ") differs from its file in slab ", what,
                  ": the unit file changed during the save, or the copy failed; nothing was replaced"));
      }
    });
    f.forget();
  }
}

// Whether `dir` holds a taskswap checkpoint's manifest (whatever the state of its data).
bool holds_a_checkpoint(const std::filesystem::path& dir)
{
  std::ifstream in(dir / manifest_file, std::ios::binary);
  if (!in) { return false; }
  try {
    const toml::table t = toml::parse(in, (dir / manifest_file).string());
    return t["format"].value<std::string>() == checkpoint_format;
  } catch (const toml::parse_error&) {
    return false;
  }
}

// Temporary directories a save left when its process died (".ck.tmp-<pid>" of a pid not alive).
void remove_stale_temporaries(const std::filesystem::path& parent, const std::string& prefix)
{
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) { continue; }
    const std::string pid = name.substr(prefix.size());
    char* end = nullptr;
    const long value = std::strtol(pid.c_str(), &end, 10);
    if (pid.empty() || *end != '\0' || value <= 0 || value == ::getpid()) { continue; }
    if (::kill(static_cast<pid_t>(value), 0) != 0 && errno == ESRCH) {
      std::filesystem::remove_all(entry.path(), ec);
      detail::log(log_level::info,
                  message("checkpoint: removed '", entry.path().string(), "', left by a save that died"));
    }
  }
}

}  // namespace

void write_checkpoint(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                      std::span<const checkpoint_source> units)
{
  namespace fs = std::filesystem;
  fs::path target = fs::absolute(dir).lexically_normal();
  if (target.filename().empty()) { target = target.parent_path(); }  // "ck/" names "ck"
  const fs::path parent = target.parent_path();
  std::error_code ec;
  if (fs::exists(target, ec) &&
      (!fs::is_directory(target, ec) || (!fs::is_empty(target, ec) && !holds_a_checkpoint(target)))) {
    throw checkpoint_error(message("'", target.string(),
                                   "' exists and is not a taskswap checkpoint; choose another path "
                                   "or move it away"));
  }
  if (!fs::is_directory(parent, ec)) {
    throw checkpoint_error(message("cannot write the checkpoint '", target.string(), "': the directory '",
                                   parent.string(), "' does not exist; create it first"));
  }
  const std::string temporary = message(".", target.filename().string(), ".tmp-");
  remove_stale_temporaries(parent, temporary);
  const fs::path tmp = parent / message(temporary, ::getpid());
  const fs::path old = parent / message(".", target.filename().string(), ".old-", ::getpid());
  fs::remove_all(tmp, ec);  // a leftover of this process's earlier failure
  if (::mkdir(tmp.c_str(), 0755) != 0) {
    throw checkpoint_error(message("cannot create '", tmp.string(), "': ", system_reason(), "; check that '",
                                   parent.string(), "' is writable"));
  }
  bool placed = false;  // the new checkpoint is at `target`
  fs::path leftover = tmp;
  try {
    {
      checkpoint_file data(tmp / data_file, O_WRONLY | O_CREAT | O_EXCL);
      for (const checkpoint_source& u : units) {
        if (!u.file.empty()) { continue; }
        for (const home_range& r : {u.params, u.master, u.m, u.v}) {
          data.write_all(u.home.subspan(r.offset, r.bytes));
        }
      }
      data.sync();
    }
    const fs::path own = tmp / units_dir;  // the disk homes' unit files
    for (const checkpoint_source& u : units) {
      if (u.file.empty()) { continue; }
      if (!fs::exists(own, ec) && ::mkdir(own.c_str(), 0755) != 0) {
        throw checkpoint_error(message("cannot create '", own.string(), "': ", system_reason()));
      }
      copy_unit_file(u.file, own / u.file.filename());
    }
    if (fs::exists(own, ec)) {
      flush_directory(own);
      verify_copies(tmp, manifest);
    }
    {
      const std::string text = manifest_text(manifest);
      checkpoint_file f(tmp / manifest_file, O_WRONLY | O_CREAT | O_EXCL);
      f.write_all(std::as_bytes(std::span(text.data(), text.size())));
      f.sync();
    }
    flush_directory(tmp);
    if (!fs::exists(target, ec)) {
      if (::rename(tmp.c_str(), target.c_str()) != 0) {
        throw checkpoint_error(
          message("cannot rename '", tmp.string(), "' to '", target.string(), "': ", system_reason()));
      }
      leftover.clear();
    } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      leftover = tmp;  // now the old checkpoint
    } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
      // No atomic exchange on this filesystem (NFS, Lustre, …): move the old checkpoint aside, put
      // the new one in place, then remove the old. A crash between the two renames leaves the old
      // checkpoint complete at `old`.
      if (::rename(target.c_str(), old.c_str()) != 0) {
        throw checkpoint_error(
          message("cannot move the old checkpoint '", target.string(), "' aside: ", system_reason()));
      }
      if (::rename(tmp.c_str(), target.c_str()) != 0) {
        const std::string reason = system_reason();
        static_cast<void>(::rename(old.c_str(), target.c_str()));  // put the old one back
        throw checkpoint_error(message("cannot rename '", tmp.string(), "' to '", target.string(), "': ", reason));
      }
      leftover = old;
    } else {
      throw checkpoint_error(
        message("cannot put the new checkpoint in place of '", target.string(), "': ", system_reason()));
    }
    placed = true;
    flush_directory(parent);
  } catch (const checkpoint_error& e) {
    if (!placed) {
      fs::remove_all(tmp, ec);
      throw;
    }
    // In place, but the directory's new entry may not be on the disk yet.
    fs::remove_all(leftover, ec);
    throw checkpoint_error(message("the checkpoint '", target.string(),
                                   "' is in place, but flushing its directory failed (", e.what(),
                                   "); after a crash the old one may come back"));
  }
  if (!leftover.empty()) { fs::remove_all(leftover, ec); }
  if (ec) {
    detail::log(log_level::warning, message("checkpoint: could not remove '", leftover.string(), "': ", ec.message()));
  }
}

std::vector<std::size_t> match_units(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                                     std::span<const checkpoint_source> units)
{
  const std::string where = message("checkpoint '", dir.string(), "'");
  std::vector<std::size_t> out;
  std::vector<bool> used(manifest.units.size(), false);
  for (const checkpoint_source& u : units) {
    const auto it = std::find_if(manifest.units.begin(), manifest.units.end(),
                                 [&](const checkpoint_unit& c) { return c.name == u.name; });
    if (it == manifest.units.end()) {
      throw checkpoint_error(message(where, " has no unit '", u.name, "', which this runtime registers; it holds ",
                                     manifest.units.size(), " units of another model"));
    }
    const checkpoint_unit& c = *it;
    if (c.compute != u.compute) {
      throw checkpoint_error(message(where, ": unit '", u.name, "' is ", to_string(c.compute),
                                     " in the checkpoint but ", to_string(u.compute), " in this runtime"));
    }
    if (c.trainable != u.trainable) {
      const auto what = [](bool trainable) { return trainable ? "trainable" : "never trained (trainable = false)"; };
      throw checkpoint_error(message(where, ": unit '", u.name, "' is ", what(c.trainable), " in the checkpoint but ",
                                     what(u.trainable), " in this runtime; register it as it was saved"));
    }
    if (c.tensors.size() != u.tensors.size()) {
      throw checkpoint_error(message(where, ": unit '", u.name, "' has ", c.tensors.size(),
                                     " tensors in the checkpoint but ", u.tensors.size(), " in this runtime"));
    }
    for (std::size_t i = 0; i < u.tensors.size(); ++i) {
      const auto& [name, shape] = c.tensors[i];
      if (name != u.tensors[i].first || shape != u.tensors[i].second) {
        const auto text = [](const std::vector<std::size_t>& s) {
          std::string t = "[";
          for (std::size_t k = 0; k < s.size(); ++k) { t += (k == 0 ? "" : ", ") + std::to_string(s[k]); }
          return t + "]";
        };
        throw checkpoint_error(message(where, ": unit '", u.name, "' tensor ", i, " is '", name, "' ", text(shape),
                                       " in the checkpoint but '", u.tensors[i].first, "' ", text(u.tensors[i].second),
                                       " in this runtime"));
      }
    }
    const auto sizes_match = [&](const checkpoint_slab& s, const home_range& mine, std::string_view what) {
      if (s.bytes != mine.bytes) {
        throw checkpoint_error(message(where, ": unit '", u.name, "' slab ", what, " has ", s.bytes,
                                       " bytes in the checkpoint but ", mine.bytes, " in this runtime"));
      }
    };
    sizes_match(c.params, u.params, "params");
    if (c.master) { sizes_match(*c.master, u.master, "master"); }
    sizes_match(c.m, u.m, "m");
    sizes_match(c.v, u.v, "v");
    used[static_cast<std::size_t>(it - manifest.units.begin())] = true;
    out.push_back(static_cast<std::size_t>(it - manifest.units.begin()));
  }
  for (std::size_t i = 0; i < used.size(); ++i) {
    if (!used[i]) {
      throw checkpoint_error(
        message(where, " has unit '", manifest.units[i].name,
                "', which this runtime does not register; register it or use a checkpoint of this model"));
    }
  }
  return out;
}

void read_checkpoint(const std::filesystem::path& dir, const checkpoint_manifest& manifest,
                     std::span<const checkpoint_source> units, std::span<const std::size_t> where)
{
  checkpoint_file data(dir / data_file, O_RDONLY);
  std::vector<std::byte> buffer;
  for (std::size_t i = 0; i < units.size(); ++i) {
    const checkpoint_unit& c = manifest.units[where[i]];
    const checkpoint_source& u = units[i];
    std::optional<checkpoint_file> own;  // the unit's file in the checkpoint's units/
    if (!c.file.empty()) { own.emplace(open_checkpoint_file(dir, c)); }
    checkpoint_file& from = own ? *own : data;
    std::optional<checkpoint_file> to;  // a disk home: its unit file, written in place
    if (!u.file.empty()) { to.emplace(u.file, O_WRONLY); }
    const auto read = [&](const checkpoint_slab& s, const home_range& into, std::string_view what) {
      std::uint32_t crc = 0;
      for (std::uint64_t done = 0; done < s.bytes;) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(io_chunk, s.bytes - done));
        std::span<std::byte> chunk;
        if (to) {
          buffer.resize(n);
          chunk = buffer;
        } else {
          chunk = u.home.subspan(into.offset + done, n);
        }
        from.read_at(chunk, s.offset + done);
        crc = crc32c(chunk, crc);
        if (to) { to->write_at(chunk, into.offset + done); }
        done += n;
      }
      if (crc != s.crc32c) {
        throw checkpoint_error(message("checkpoint '", dir.string(), "': unit '", u.name, "' slab ", what,
                                       " changed while it was being loaded; the runtime's home copies are partly "
                                       "overwritten: load a checkpoint again before training"));
      }
    };
    read(c.params, u.params, "params");
    if (c.master) { read(*c.master, u.master, "master"); }
    read(c.m, u.m, "m");
    read(c.v, u.v, "v");
    if (own) { own->forget(); }
    if (to) {
      to->sync();
      to->forget();  // the host cache reads it with direct I/O
    }
  }
}

}  // namespace detail
}  // namespace taskswap
