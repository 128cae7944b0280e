// SPDX-License-Identifier: Apache-2.0
// The emulated device's virtual memory. With a granule of whole host pages, the device's physical
// memory is one memory file: a handle is a set of granule runs in it (backed when a handle first
// takes them, and kept backed for the next handle: as the driver's memory, a new handle's bytes
// are whatever they were), and mapping a handle maps its runs into the range, so ranges alias
// handles as CUDA's do. Below a page nothing can be mapped: each range is anonymous
// memory of its own, and handles are only counted.
//
// The rules the CUDA driver enforces are enforced here too, so that the device pool breaks them on
// no device: a handle is mapped whole at addresses that are unmapped; an unmap covers whole
// mappings; a handle is released only when it is mapped nowhere. Each call costs its caller the
// host time of the device's vm_cost_model, the emulator's own work in the call included.

#include "device/emulated/emulated_backend.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <memory>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

namespace taskswap::detail {

namespace {

std::size_t host_page_size() noexcept
{
  static const std::size_t page = [] {
    const long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<std::size_t>(p) : std::size_t{4096};
  }();
  return page;
}

// `error` is errno as the failed call left it (building the message may change errno).
[[noreturn]] void throw_errno(int error, const std::string& what)
{
  throw device_error(message(what, ": ", std::strerror(error)));
}

struct emulated_handle {
  // NOLINTBEGIN(misc-non-private-member-variables-in-classes)
  std::size_t granules = 0;
  std::vector<std::pair<std::size_t, std::size_t>> runs;  // (first granule, count) in the memory file
  std::size_t mappings = 0;
  // NOLINTEND(misc-non-private-member-variables-in-classes)
};

}  // namespace

emulated_backend::vm_table::~vm_table()
{
  if (fd >= 0) { ::close(fd); }
}

// Runs of `count` granules, first fit; the caller checked that the file has them.
std::vector<std::pair<std::size_t, std::size_t>> emulated_backend::vm_table::take(std::size_t count)
{
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  for (auto it = free_runs.begin(); count > 0 && it != free_runs.end();) {
    const std::size_t n = std::min(count, it->second);
    runs.emplace_back(it->first, n);
    count -= n;
    const std::pair<std::size_t, std::size_t> rest{it->first + n, it->second - n};
    it = free_runs.erase(it);
    if (rest.second > 0) { it = free_runs.insert(rest).first; }
  }
  return runs;
}

void emulated_backend::vm_table::give(std::size_t first, std::size_t count)
{
  auto next = free_runs.lower_bound(first);
  if (next != free_runs.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      count += prev->second;
      free_runs.erase(prev);
    }
  }
  next = free_runs.find(first + count);
  if (next != free_runs.end()) {
    count += next->second;
    free_runs.erase(next);
  }
  free_runs.emplace(first, count);
}

bool emulated_backend::maps_pages() const noexcept { return options_.granularity % host_page_size() == 0; }

void* emulated_backend::vm_create(std::size_t granules)
{
  const auto started = std::chrono::steady_clock::now();
  const std::size_t g = options_.granularity;
  const std::size_t bytes = granules * g;
  take_memory(bytes);
  const double seconds = cost(options_.vm_costs.create, 1, bytes);
  auto h = std::make_unique<emulated_handle>();
  h->granules = granules;
  if (!maps_pages()) {
    charge(seconds, started);
    return h.release();
  }
  vm_table& t = vm_;
  {  // the call's time is charged after the lock: other threads' calls do not wait it out
    const std::lock_guard lock(t.mutex);
    int error = 0;
    if (t.fd < 0) {
      // The file spans the device's memory; its runs are backed as handles take them.
      const std::size_t file_granules = options_.memory_bytes / g;
      t.fd = ::memfd_create("taskswap-emulated-device", MFD_CLOEXEC);
      error = t.fd < 0 ? errno : ::ftruncate(t.fd, static_cast<off_t>(file_granules * g)) == 0 ? 0 : errno;
      if (error == 0) { t.free_runs.emplace(0, file_granules); }
    }
    if (error == 0) {
      h->runs = t.take(granules);
      // Backed now, as cuMemCreate is: a host that cannot hold it fails here, not with SIGBUS
      // inside a copy, and no page fault lands in a timed copy. Runs backed before cost nothing.
      for (const auto& [first, count] : h->runs) {
        const int e = ::posix_fallocate(t.fd, static_cast<off_t>(first * g), static_cast<off_t>(count * g));
        if (e != 0 && e != EOPNOTSUPP && e != EINVAL) {  // no fallocate on this file system: sparse
          error = e;
          break;
        }
      }
    }
    if (error != 0) {
      for (const auto& [first, count] : h->runs) { t.give(first, count); }
      give_memory(bytes);
      if (error == ENOSPC || error == ENOMEM) {
        throw out_of_memory(message("emulated:", index_, ": the host could not provide ", bytes_text(bytes),
                                    " to stand for device memory"),
                            bytes, 0, options_.memory_bytes);
      }
      throw_errno(error, message("emulated:", index_, ": a memory file of ", bytes_text(bytes), " for device memory"));
    }
  }
  charge(seconds, started);
  return h.release();
}

void emulated_backend::vm_release(void* handle, std::size_t granules)
{
  std::unique_ptr<emulated_handle> h(static_cast<emulated_handle*>(handle));
  TASKSWAP_EXPECTS(h->granules == granules, message("emulated:", index_, ": releasing a handle of ", h->granules,
                                                    " granules as one of ", granules));
  if (h->mappings != 0) {
    const std::size_t n = h->mappings;
    static_cast<void>(h.release());  // still mapped: it stays, as the driver would keep it
    throw device_error(message("emulated:", index_, ": releasing a handle still mapped at ", n,
                               " addresses; unmap it first (its memory could not be given back)"));
  }
  const auto started = std::chrono::steady_clock::now();
  const std::size_t g = options_.granularity;
  if (maps_pages()) {
    vm_table& t = vm_;
    const std::lock_guard lock(t.mutex);
    for (const auto& [first, count] : h->runs) { t.give(first, count); }  // still backed
  }
  give_memory(granules * g);
  charge(cost(options_.vm_costs.release, 1, granules * g), started);
}

std::byte* emulated_backend::vm_reserve(std::size_t bytes)
{
  // Below a page a range holds its own bytes, so it is readable and writable from the start.
  const int protection = maps_pages() ? PROT_NONE : PROT_READ | PROT_WRITE;
  void* va = ::mmap(nullptr, bytes, protection, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (va == MAP_FAILED) {
    throw_errno(errno, message("emulated:", index_, ": reserving ", bytes_text(bytes), " of addresses"));
  }
  return static_cast<std::byte*>(va);
}

void emulated_backend::vm_free(std::byte* va, std::size_t bytes) noexcept { ::munmap(va, bytes); }

void emulated_backend::vm_map(std::byte* va, void* handle, std::size_t granules)
{
  const auto started = std::chrono::steady_clock::now();
  check_fault();
  auto* h = static_cast<emulated_handle*>(handle);
  const std::size_t g = options_.granularity;
  TASKSWAP_EXPECTS(h->granules == granules, message("emulated:", index_, ": mapping ", granules,
                                                    " granules of a handle of ", h->granules, "; map a handle whole"));
  const auto at = reinterpret_cast<std::uintptr_t>(va);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
  vm_table& t = vm_;
  {
    const std::lock_guard lock(t.mutex);
    auto next = t.mapped.lower_bound(at);
    const bool overlaps = (next != t.mapped.end() && next->first < at + granules * g) ||
                          (next != t.mapped.begin() && std::prev(next)->first + std::prev(next)->second.first * g > at);
    if (overlaps) {
      throw device_error(message("emulated:", index_, ": mapping at ", static_cast<void*>(va),
                                 ", where a handle is mapped already; unmap it first"));
    }
    t.mapped.emplace(at, std::pair<std::size_t, void*>{granules, h});
    ++h->mappings;
  }
  const double seconds = cost(options_.vm_costs.map, 1, granules * g) + cost(options_.vm_costs.access, 1, granules * g);
  std::size_t offset = 0;
  for (const auto& [first, count] : h->runs) {
    if (::mmap(va + offset, count * g, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, t.fd,
               static_cast<off_t>(first * g)) == MAP_FAILED) {
      throw_errno(errno, message("emulated:", index_, ": mapping ", count, " granules at ", static_cast<void*>(va)));
    }
    offset += count * g;
  }
  charge(seconds, started);
}

void emulated_backend::vm_unmap(std::byte* va, std::size_t granules)
{
  const auto started = std::chrono::steady_clock::now();
  const std::size_t g = options_.granularity;
  const auto at = reinterpret_cast<std::uintptr_t>(va);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
  std::size_t handles = 0;
  {
    vm_table& t = vm_;
    const std::lock_guard lock(t.mutex);
    std::size_t covered = 0;
    auto it = t.mapped.find(at);
    while (covered < granules && it != t.mapped.end() && it->first == at + covered * g) {
      covered += it->second.first;
      ++handles;
      ++it;
    }
    if (covered != granules) {
      throw device_error(message("emulated:", index_, ": unmapping ", granules, " granules at ", static_cast<void*>(va),
                                 ", which are not whole handles mapped one after another"));
    }
    for (auto e = t.mapped.find(at); e != it;) {
      --static_cast<emulated_handle*>(e->second.second)->mappings;
      e = t.mapped.erase(e);
    }
  }
  const double seconds = cost(options_.vm_costs.unmap, handles, granules * g);
  if (maps_pages() && ::mmap(va, granules * g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
                             0) == MAP_FAILED) {
    throw_errno(errno, message("emulated:", index_, ": unmapping ", granules, " granules at ", static_cast<void*>(va)));
  }
  charge(seconds, started);
}

}  // namespace taskswap::detail
