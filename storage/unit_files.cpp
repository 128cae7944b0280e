// SPDX-License-Identifier: Apache-2.0
// The disk home tier's files: Note [Unit files] in storage/unit_files.hpp.

#include "storage/unit_files.hpp"

#include "device/expects.hpp"
#include "device/log.hpp"
#include "device/message.hpp"
#include "numeric/align.hpp"
#include "storage/posix_file.hpp"

#include <taskswap/error.hpp>

#include <fcntl.h>
#include <liburing.h>
#include <sys/file.h>  // flock
#include <sys/resource.h>  // RLIMIT_NOFILE
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <deque>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace taskswap::detail {
namespace {

constexpr std::size_t direct_alignment = 4096;  // the largest logical block size of today's drives
constexpr std::size_t max_registered = std::size_t{1} << 30;  // the kernel's limit per registered buffer

std::string errno_text(int e) { return message(std::generic_category().message(e), " (errno ", e, ")"); }

struct unit_file {
  std::string unit;
  std::filesystem::path path;
  posix_file file;
  std::size_t bytes = 0;
  bool existed = false;
};

std::string no_space_text(const unit_file& f, int e)
{
  struct statvfs fs {};
  const std::size_t free_bytes = ::fstatvfs(f.file.fd(), &fs) == 0 ? std::size_t{fs.f_bavail} * fs.f_frsize : 0;
  return message("unit '", f.unit, "' needs ", bytes_text(f.bytes), " for its file '", f.path.string(),
                 "': ", errno_text(e), "; the drive has ", bytes_text(free_bytes),
                 " free: free space or set [storage] path to a larger drive");
}

// One request to the ring: a block of a transfer, or the rest of one that came back short.
struct block {
  std::uint64_t transfer = 0;
  unit_files::file_index file = 0;
  std::size_t offset = 0;  // in the file
  std::byte* buffer = nullptr;
  std::size_t bytes = 0;
  bool write = false;
  std::uint64_t request = 0;  // its number among the requests sent (faults count these)
};

struct transfer_state {
  std::size_t blocks_left = 0;
  std::string error;  // the first failure
};

}  // namespace

struct unit_files::impl {
  unit_file_options options;
  // The directory, open and locked (flock) while a unit_files uses it: two runs, or two ranks,
  // sharing it would read and write each other's unit files.
  posix_file lock;
  io_faults faults;
  io_uring ring{};
  bool direct = true;
  std::vector<unit_file> files;
  std::deque<block> waiting;  // not sent yet, in order
  std::vector<block> flight;  // by slot; a request's user data is its slot
  std::vector<std::uint32_t> free_slots;
  std::unordered_map<std::uint64_t, transfer_state> transfers;
  std::uint64_t next_transfer = 1;
  std::byte* registered = nullptr;  // registered memory, in max_registered pieces
  std::size_t registered_bytes = 0;
  bool tried_registering = false;
  unit_file_stats stats;
  std::string ring_failure;  // set once the ring itself failed: every later call throws it
  int stall_pipe[2] = {-1, -1};  // io_faults::stall_request's empty pipe

  impl(unit_file_options o, io_faults f) : options(std::move(o)), faults(f) {}

  void check_ring() const
  {
    if (!ring_failure.empty()) { throw storage_error(ring_failure); }
  }

  std::size_t alignment() const noexcept { return direct ? direct_alignment : 1; }

  void probe_direct()
  {
    const std::filesystem::path probe = options.directory / ".taskswap-direct-probe";
    int e = 0;
    bool made = false;
    {
      const posix_file f(probe, O_RDWR | O_CREAT | (faults.refuse_direct ? 0 : O_DIRECT), 0600);
      made = f.is_open();
      e = made ? (faults.refuse_direct ? EINVAL : 0) : f.error();
    }
    if (made) { ::unlink(probe.c_str()); }
    if (e == 0) { return; }
    if (e != EINVAL) {
      throw config_error(message("[storage] path '", options.directory.string(),
                                 "': cannot make a file there: ", errno_text(e), "; point it at a writable directory"));
    }
    direct = false;
    log_once(
      message("storage buffered ", options.directory.string()), log_level::warning,
      message("storage: '", options.directory.string(),
              "' does not take O_DIRECT (a tmpfs before Linux 6.6?); unit files go through the page cache, which costs "
              "host memory beside the host cache and a copy per transfer"));
  }

  std::string where(const block& b) const
  {
    const unit_file& f = files[b.file];
    return message(b.write ? "writing " : "reading ", bytes_text(b.bytes), " at offset ", b.offset, " of '",
                   f.path.string(), "' (unit '", f.unit, "')");
  }

  void finish_block(std::uint64_t transfer) { --transfers.at(transfer).blocks_left; }

  void fail(const block& b, const std::string& why)
  {
    transfer_state& t = transfers.at(b.transfer);
    if (t.error.empty()) { t.error = message(where(b), ": ", why); }
    finish_block(b.transfer);
  }

  // Registered memory holding all of [p, p + n): the index of its piece, or -1.
  int fixed_index(const std::byte* p, std::size_t n) const
  {
    if (registered == nullptr || p < registered || p + n > registered + registered_bytes) { return -1; }
    const auto first = static_cast<std::size_t>(p - registered) / max_registered;
    const auto last = static_cast<std::size_t>(p + n - 1 - registered) / max_registered;
    return first == last ? static_cast<int>(first) : -1;
  }

  // Sends waiting blocks while places are free; a block of a failed transfer is dropped.
  void send()
  {
    bool queued = false;
    while (!waiting.empty() && !free_slots.empty()) {
      block b = waiting.front();
      if (!transfers.at(b.transfer).error.empty()) {
        waiting.pop_front();
        finish_block(b.transfer);
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) { break; }  // cannot happen with as many entries as places; sent next time
      waiting.pop_front();
      const std::uint32_t slot = free_slots.back();
      free_slots.pop_back();
      b.request = ++stats.requests;
      const int fd = files[b.file].file.fd();
      const auto n = static_cast<unsigned>(b.bytes);
      const auto off = static_cast<__u64>(b.offset);
      const int fixed = fixed_index(b.buffer, b.bytes);
      if (b.request == faults.stall_request) {
        io_uring_prep_read(sqe, stall_pipe[0], b.buffer, n, ~__u64{0});  // nothing is ever written to it
      } else if (fixed >= 0) {
        ++stats.fixed;
        if (b.write) {
          io_uring_prep_write_fixed(sqe, fd, b.buffer, n, off, fixed);
        } else {
          io_uring_prep_read_fixed(sqe, fd, b.buffer, n, off, fixed);
        }
      } else if (b.write) {
        io_uring_prep_write(sqe, fd, b.buffer, n, off);
      } else {
        io_uring_prep_read(sqe, fd, b.buffer, n, off);
      }
      io_uring_sqe_set_data64(sqe, slot);
      flight[slot] = b;
      queued = true;
    }
    if (!queued) { return; }
    // The kernel may take fewer than were queued (it stops at a request it cannot start): what it
    // left is submitted again, so that every place marked in flight is.
    for (;;) {
      const int r = io_uring_submit(&ring);
      if (r == -EINTR) { continue; }
      if (r < 0 || (r == 0 && io_uring_sq_ready(&ring) != 0)) {
        ring_failure = message("storage: io_uring_submit failed: ", errno_text(r < 0 ? -r : EAGAIN), " (", in_flight(),
                               " requests in flight, queue depth ", options.queue_depth,
                               "); the unit files keep what was written before; the last checkpoint still resumes");
        check_ring();
      }
      if (io_uring_sq_ready(&ring) == 0) { return; }
    }
  }

  [[nodiscard]] std::size_t in_flight() const noexcept { return flight.size() - free_slots.size(); }

  void complete(std::uint32_t slot, int res)
  {
    block b = flight.at(slot);
    free_slots.push_back(slot);
    if (b.request == faults.fail_request) { res = -faults.fail_errno; }
    if (b.request == faults.short_request && res > 0) {
      res = static_cast<int>(std::min(static_cast<std::size_t>(res), faults.short_bytes));
    }
    if (res == -EAGAIN || res == -EINTR) {  // not done; send it again
      ++stats.resent;
      waiting.push_front(b);
      return;
    }
    if (res < 0) {
      fail(b, errno_text(-res));
      return;
    }
    const auto got = static_cast<std::size_t>(res);
    (b.write ? stats.bytes_written : stats.bytes_read) += got;
    if (got != b.bytes && got % alignment() != 0) {  // the rest could not go as direct I/O
      fail(b, message("the drive moved ", got, " of the bytes, not a multiple of ", alignment(),
                      ", so the rest cannot be sent again with O_DIRECT"));
      return;
    }
    if (got == b.bytes) {
      finish_block(b.transfer);
      return;
    }
    if (got == 0) {
      fail(b, b.write ? "the drive took none of the bytes"
                      : "the file ends before them (a short read: was the file truncated or replaced under the run?)");
      return;
    }
    ++stats.resent;  // a short transfer: the rest goes again
    b.offset += got;
    b.buffer += got;
    b.bytes -= got;
    waiting.push_front(b);
  }

  // Waits for a completion for at most the timeout: 0, -ETIME when none came, or another error.
  int wait_one(io_uring_cqe** cqe)
  {
    using clock = std::chrono::steady_clock;
    const clock::time_point deadline = clock::now() + options.timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - clock::now());
      if (left.count() <= 0) { return io_uring_peek_cqe(&ring, cqe) == 0 ? 0 : -ETIME; }  // one that came at the end
      __kernel_timespec ts{.tv_sec = left.count() / 1'000'000'000, .tv_nsec = left.count() % 1'000'000'000};
      const int r = io_uring_wait_cqe_timeout(&ring, cqe, &ts);
      if (r != -EINTR && r != -ETIME) { return r; }
    }
  }

  // Asks the kernel to cancel every request in flight (a drive that stopped answering), without
  // waiting: a request the kernel can cancel ends; block I/O stuck in a drive may not.
  void cancel_in_flight()
  {
    for (const std::uint32_t s : busy_slots()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) { break; }
      io_uring_prep_cancel64(sqe, s, 0);
      io_uring_sqe_set_data64(sqe, LIBURING_UDATA_TIMEOUT);  // its completion is skipped as liburing's are
    }
    (void)io_uring_submit(&ring);
  }

  // The places with a request in flight.
  [[nodiscard]] std::vector<std::uint32_t> busy_slots() const
  {
    std::vector<bool> is_free(flight.size());
    for (const std::uint32_t s : free_slots) { is_free[s] = true; }
    std::vector<std::uint32_t> busy;
    for (std::uint32_t s = 0; s < flight.size(); ++s) {
      if (!is_free[s]) { busy.push_back(s); }
    }
    return busy;
  }

  // What a drive that stopped answering leaves: the oldest request in flight, by file and unit.
  std::string stalled_text() const
  {
    const block* oldest = nullptr;
    for (const std::uint32_t s : busy_slots()) {
      if (oldest == nullptr || flight[s].request < oldest->request) { oldest = &flight[s]; }
    }
    const std::string waited =
      message(std::chrono::duration<double>(options.timeout).count(), " s ([storage] timeout)");
    if (oldest == nullptr) { return message("storage: the drive answered nothing for ", waited); }
    const unit_file& file = files.at(oldest->file);
    return message("storage: the drive answered none of ", in_flight(), " requests for ", waited, "; the oldest is ",
                   oldest->write ? "writing '" : "reading '", file.path.string(), "' (unit '", file.unit,
                   "') at offset ", oldest->offset,
                   ". The unit files keep what was written before; the last checkpoint still resumes");
  }

  // Takes the completions there are; with `block_for_one`, waits for one first if none is there.
  void reap(bool block_for_one)
  {
    io_uring_cqe* cqe = nullptr;
    if (block_for_one && in_flight() != 0) {
      const int r = wait_one(&cqe);
      if (r == -ETIME) {
        ring_failure = stalled_text();
        cancel_in_flight();
        check_ring();
      }
      if (r < 0) {
        ring_failure = message("storage: io_uring_wait_cqe failed: ", errno_text(-r));
        check_ring();
      }
    }
    unsigned head = 0;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe)
    {
      // Before Linux 5.11 a wait with a timeout queues liburing's own timeout request.
      if (cqe->user_data != LIBURING_UDATA_TIMEOUT) {
        complete(static_cast<std::uint32_t>(io_uring_cqe_get_data64(cqe)), cqe->res);
      }
      ++seen;
    }
    io_uring_cq_advance(&ring, seen);
    send();
  }

  transfer start(file_index f, std::size_t offset, std::byte* buffer, std::size_t bytes, bool write)
  {
    check_ring();
    TASKSWAP_EXPECTS(f < files.size(), message("unit file ", f, " was not opened"));
    const unit_file& file = files[f];
    TASKSWAP_EXPECTS(offset <= file.bytes && bytes <= file.bytes - offset,
                     message(write ? "writing " : "reading ", bytes, " bytes at offset ", offset, " of '",
                             file.path.string(), "' (unit '", file.unit, "'): past its ", file.bytes, " bytes"));
    const std::size_t a = alignment();
    TASKSWAP_EXPECTS(offset % a == 0 && bytes % a == 0 && std::bit_cast<std::uintptr_t>(buffer) % a == 0,
                     message(write ? "writing " : "reading ", "'", file.path.string(), "' (unit '", file.unit,
                             "'): direct I/O needs the offset (", offset, "), the length (", bytes,
                             ") and the buffer's address to be multiples of ", a));
    const std::uint64_t id = next_transfer++;
    transfer_state& t = transfers[id];
    for (std::size_t done = 0; done < bytes; done += options.block_bytes) {
      const std::size_t n = std::min(options.block_bytes, bytes - done);
      waiting.push_back(block{.transfer = id,
                              .file = f,
                              .offset = offset + done,
                              .buffer = buffer + done,
                              .bytes = n,
                              .write = write,
                              .request = 0});
      ++t.blocks_left;
    }
    send();
    return transfer{id};
  }

  transfer_state& state(transfer t)
  {
    const auto it = transfers.find(t.id);
    TASKSWAP_EXPECTS(it != transfers.end(), message("transfer ", t.id, " is not in progress (waited for already?)"));
    return it->second;
  }
};

unit_files::unit_files(unit_file_options options, io_faults faults)
    : impl_(std::make_unique<impl>(std::move(options), faults))
{
  const unit_file_options& o = impl_->options;
  TASKSWAP_EXPECTS(o.queue_depth >= 1 && o.queue_depth <= 4096,
                   message("[storage] queue_depth = ", o.queue_depth, ": give 1 to 4096 requests in flight"));
  TASKSWAP_EXPECTS(
    o.block_bytes >= direct_alignment && o.block_bytes % direct_alignment == 0 && o.block_bytes <= max_registered,
    message("[storage] block = ", o.block_bytes, " bytes: give a multiple of ", direct_alignment,
            " bytes of at most 1 GiB"));
  std::error_code ec;
  std::filesystem::create_directories(o.directory, ec);
  if (ec) {
    throw config_error(message("[storage] path '", o.directory.string(), "': cannot make the directory: ", ec.message(),
                               "; point it at a writable directory on a local drive"));
  }
  impl_->lock = posix_file(o.directory, O_RDONLY | O_DIRECTORY);
  const int e = impl_->lock.is_open() ? impl_->lock.lock() : impl_->lock.error();
  if (e != 0) {
    throw config_error(message(
      "[storage] path '", o.directory.string(), "': ",
      e == EWOULDBLOCK ? std::string("another run (or rank) uses this directory") : "cannot lock it: " + errno_text(e),
      "; give each run and each rank its own directory"));
  }
  TASKSWAP_EXPECTS(o.timeout.count() > 0 && o.timeout <= std::chrono::hours(24 * 365),
                   message("[storage] timeout = ", o.timeout.count(), " ms: give more than 0 and at most a year"));
  if (faults.stall_request != 0 && ::pipe2(impl_->stall_pipe, O_CLOEXEC) != 0) {
    throw storage_error(message("io_faults::stall_request: pipe2 failed: ", errno_text(errno)));
  }
  impl_->probe_direct();
  const int r = io_uring_queue_init(o.queue_depth, &impl_->ring, 0);
  if (r < 0) {
    throw storage_error(message("storage: io_uring_queue_init(", o.queue_depth, ") failed: ", errno_text(-r),
                                "; the disk tier needs io_uring (Linux 5.6 or later, not disabled by "
                                "kernel.io_uring_disabled or a container's seccomp profile), or keep home = \"host\""));
  }
  impl_->flight.resize(o.queue_depth);
  for (std::uint32_t s = o.queue_depth; s > 0; --s) { impl_->free_slots.push_back(s - 1); }
}

unit_files::~unit_files()
{
  impl& m = *impl_;
  m.waiting.clear();
  // After a ring failure requests the kernel never took would be waited for in vain, and a drive
  // that answers none within the timeout is not waited for again.
  while (m.ring_failure.empty() && m.in_flight() != 0) {
    io_uring_cqe* cqe = nullptr;
    const int r = m.wait_one(&cqe);
    if (r == -ETIME) { log(log_level::warning, m.stalled_text() + "; the unit files are closed anyway"); }
    if (r < 0 || cqe == nullptr) { break; }  // the ring failed: nothing more will complete
    m.free_slots.push_back(static_cast<std::uint32_t>(io_uring_cqe_get_data64(cqe)));
    io_uring_cqe_seen(&m.ring, cqe);
  }
  // A request still in flight after a timeout was asked to cancel. O_DIRECT and registered buffers
  // stay pinned by the kernel until it ends; with buffered I/O a request the drive never ends
  // could still copy into its buffer after the memory is freed (docs/storage.md, Faults).
  io_uring_queue_exit(&m.ring);
  m.files.clear();  // closed after the ring
  for (const int fd : m.stall_pipe) {
    if (fd >= 0) { ::close(fd); }
  }
}

std::string unit_files::file_name(std::string_view unit, std::uint64_t identity)
{
  std::string out;
  char text[24];
  for (const char c : unit) {  // letters, digits, '_' and '-' as they are; any other byte as %hh
    const auto b = static_cast<unsigned char>(c);
    const bool plain =
      (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || (b >= '0' && b <= '9') || b == '_' || b == '-';
    std::snprintf(text, sizeof text, "%%%02x", static_cast<unsigned>(b));
    out += plain ? std::string_view(&c, 1) : std::string_view(text);
  }
  std::snprintf(text, sizeof text, ".%016llx.unit", static_cast<unsigned long long>(identity));
  return out + text;
}

// Note [Open files] (unit_files.hpp)
bool unit_files::raise_open_file_limit()
{
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) { return false; }
  const rlim_t was = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) { return false; }
  log_once(
    "storage open files", log_level::info,
    message("storage: ", impl_->files.size(), " unit files are open; raised this process's open-file limit from ", was,
            " to its hard limit, ", limit.rlim_max));
  return true;
}

unit_files::file_index unit_files::open(std::string_view unit, std::uint64_t identity, std::size_t bytes)
{
  impl& m = *impl_;
  m.check_ring();
  unit_file f{.unit = std::string(unit), .path = m.options.directory / file_name(unit, identity), .file = {}};
  const int flags = O_RDWR | O_CREAT | (m.direct ? O_DIRECT : 0);
  f.existed = std::filesystem::exists(f.path);
  f.file = posix_file(f.path, flags);
  if (!f.file.is_open() && f.file.error() == EMFILE && raise_open_file_limit()) { f.file = posix_file(f.path, flags); }
  if (!f.file.is_open()) {
    const int e = f.file.error();
    rlimit limit{};
    (void)::getrlimit(RLIMIT_NOFILE, &limit);
    throw storage_error(
      e == EMFILE ? message("opening '", f.path.string(), "' for unit '", unit, "': ", errno_text(e),
                            ". Each disk-homed unit keeps its file open (", m.files.size(),
                            " so far) and this process may open ", limit.rlim_cur,
                            " files in all; raise the limit (ulimit -n, or LimitNOFILE in a systemd unit) above the "
                            "number of disk-homed units plus what the trainer opens besides")
                  : message("opening '", f.path.string(), "' for unit '", unit, "': ", errno_text(e),
                            "; check that [storage] path is a writable directory"));
  }
  f.bytes = round_up(bytes, m.alignment());
  struct stat st {};
  int e = f.file.status(st);
  if (e == 0 && static_cast<std::size_t>(st.st_size) < f.bytes) { e = f.file.reserve(f.bytes); }
  if (e != 0) {
    const std::string why = no_space_text(f, e);
    f.file = posix_file();
    if (!f.existed) { ::unlink(f.path.c_str()); }
    throw storage_error(why);
  }
  m.files.push_back(std::move(f));
  return static_cast<file_index>(m.files.size() - 1);
}

bool unit_files::existed(file_index f) const { return impl_->files.at(f).existed; }
const std::filesystem::path& unit_files::path(file_index f) const { return impl_->files.at(f).path; }
std::size_t unit_files::file_bytes(file_index f) const { return impl_->files.at(f).bytes; }

void unit_files::register_buffers(std::span<std::byte> memory)
{
  impl& m = *impl_;
  m.check_ring();
  TASKSWAP_EXPECTS(!m.tried_registering, "unit_files::register_buffers: memory is registered once");
  m.tried_registering = true;
  if (memory.empty()) { return; }
  std::vector<iovec> pieces;
  for (std::size_t at = 0; at < memory.size(); at += max_registered) {
    pieces.push_back(iovec{memory.data() + at, std::min(max_registered, memory.size() - at)});
  }
  const int r = io_uring_register_buffers(&m.ring, pieces.data(), static_cast<unsigned>(pieces.size()));
  if (r < 0) {
    log_once(
      "storage register", log_level::warning,
      message("storage: the kernel refused to register ", bytes_text(memory.size()), " of host memory with io_uring (",
              errno_text(-r), "; raise the memlock limit, ulimit -l); unit files use plain requests"));
    return;
  }
  m.registered = memory.data();
  m.registered_bytes = memory.size();
}

unit_files::transfer unit_files::read(file_index f, std::size_t offset, std::span<std::byte> into)
{
  return impl_->start(f, offset, into.data(), into.size(), false);
}

unit_files::transfer unit_files::write(file_index f, std::size_t offset, std::span<const std::byte> from)
{
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): io_uring_prep_write takes a void* and only reads it
  return impl_->start(f, offset, const_cast<std::byte*>(from.data()), from.size(), true);
}

bool unit_files::done(transfer t)
{
  impl& m = *impl_;
  m.check_ring();
  transfer_state& s = m.state(t);
  if (s.blocks_left != 0) { m.reap(false); }
  return s.blocks_left == 0;
}

void unit_files::wait(transfer t)
{
  impl& m = *impl_;
  m.check_ring();
  transfer_state& s = m.state(t);
  while (s.blocks_left != 0) { m.reap(true); }
  const std::string error = std::move(s.error);
  m.transfers.erase(t.id);
  if (!error.empty()) { throw storage_error(error); }
}

void unit_files::zero(file_index f)
{
  const unit_file& file = impl_->files.at(f);
  int e = file.file.truncate(0);
  if (e == 0) { e = file.file.reserve(file.bytes); }
  if (e != 0) { throw storage_error(no_space_text(file, e)); }
}

void unit_files::check_present(file_index f) const
{
  const unit_file& file = impl_->files.at(f);
  struct stat st {};
  if (const int e = file.file.status(st); e != 0) {
    throw storage_error(message("checking '", file.path.string(), "' (unit '", file.unit, "'): ", errno_text(e)));
  }
  if (st.st_nlink == 0) {
    throw storage_error(message("'", file.path.string(), "', the file of unit '", file.unit,
                                "', was deleted while the run used it: its bytes are lost when the run ends; "
                                "resume from the last checkpoint"));
  }
}

void unit_files::sync(file_index f)
{
  check_present(f);
  const unit_file& file = impl_->files.at(f);
  if (const int e = file.file.sync(); e != 0) {
    throw storage_error(message("syncing '", file.path.string(), "' (unit '", file.unit, "'): ", errno_text(e),
                                "; the last checkpoint is unchanged"));
  }
}

bool unit_files::direct() const noexcept { return impl_->direct; }
std::size_t unit_files::alignment() const noexcept { return impl_->alignment(); }
const unit_file_options& unit_files::options() const noexcept { return impl_->options; }
unit_file_stats unit_files::stats() const noexcept { return impl_->stats; }

}  // namespace taskswap::detail
