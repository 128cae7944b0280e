// SPDX-License-Identifier: Apache-2.0
// The pinned, NUMA-local arena: mmap exactly the pages asked, bind them to the node (hwloc),
// fault them in with threads of that node (oneTBB) in chunks, page-lock them as one range, then hand out
// aligned slabs best-fit with coalescing.

#include "device/backend.hpp"
#include "device/best_fit_ranges.hpp"
#include "device/expects.hpp"
#include "device/log.hpp"
#include "device/message.hpp"
#include "host/host_task_arena.hpp"
#include "host/topology.hpp"
#include "numeric/align.hpp"

#include <taskswap/host.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace taskswap {

namespace {

using detail::round_up;

constexpr std::size_t huge_page = std::size_t{2} << 20;

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

std::size_t system_page() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

// Reports a phase's progress at most every 50 ms and always at the end.
class progress_reporter {
 public:
  progress_reporter(const std::function<void(const pin_progress&)>& sink, std::string_view phase, std::size_t total)
      : sink_(sink), phase_(phase), total_(total), start_(std::chrono::steady_clock::now())
  {}
  void report(std::size_t done, bool final = false)
  {
    if (!sink_) { return; }
    const auto now = std::chrono::steady_clock::now();
    if (!final && now - last_ < std::chrono::milliseconds(50)) { return; }
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    sink_({phase_, done, total_, seconds > 0 ? static_cast<double>(done) / seconds : 0.0});
  }

 private:
  const std::function<void(const pin_progress&)>& sink_;
  std::string_view phase_;
  std::size_t total_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace

struct pinned_arena::impl {
  impl(const device& d, pinned_arena_options o) : dev(d), options(std::move(o)) {}
  ~impl();
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  impl(impl&&) = delete;
  impl& operator=(impl&&) = delete;

  void map_pages();
  void bind();
  void prefault();
  void lock();
  void release_registrations() noexcept;

  device dev;
  pinned_arena_options options;
  unsigned node = 0;
  std::byte* base = nullptr;
  std::size_t reserved = 0;
  bool bound = false;
  std::size_t pinned = 0;
  std::vector<std::pair<std::size_t, std::size_t>> registrations;  // offset, bytes

  mutable std::mutex mutex;
  std::optional<detail::best_fit_ranges> slabs;  // placed once the pages are mapped
};

void pinned_arena::impl::map_pages()
{
  const std::size_t page = options.huge_pages ? huge_page : system_page();
  reserved = round_up(options.bytes, page);
  // Chunks are whole pages, so no two registrations share a page.
  options.chunk_bytes = round_up(options.chunk_bytes, page);
  void* p = MAP_FAILED;
  if (options.huge_pages) {
    p = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
      detail::log(log_level::info, detail::message("no reserved 2 MiB huge pages for a ", detail::bytes_text(reserved),
                                                   " arena (MAP_HUGETLB: ", std::strerror(errno),
                                                   "); using transparent huge pages instead"));
    }
  }
  if (p == MAP_FAILED) {
    p = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED && options.huge_pages) { static_cast<void>(::madvise(p, reserved, MADV_HUGEPAGE)); }
  }
  if (p == MAP_FAILED) {
    throw out_of_memory(detail::message("pinned arena: cannot map ", detail::bytes_text(reserved),
                                        " of host memory (mmap: ", std::strerror(errno), ")"),
                        reserved, 0, 0);
  }
  base = static_cast<std::byte*>(p);
}

void pinned_arena::impl::bind()
{
  bound = detail::topology::instance().bind_area(base, reserved, node);
  if (!bound) {
    detail::log(
      log_level::warning,
      detail::message("pinned arena: the OS refused to bind ", detail::bytes_text(reserved), " to NUMA node ", node,
                      " (", std::strerror(errno), "); pages are placed by first touch from threads of that node"));
  }
}

void pinned_arena::impl::prefault()
{
  const std::size_t chunk = options.chunk_bytes;
  const std::size_t chunks = (reserved + chunk - 1) / chunk;
  int threads = static_cast<int>(options.threads);
  if (threads == 0) { threads = static_cast<int>(detail::topology::instance().cpus_of_node(node).size()); }
  detail::host_task_arena arena(static_cast<int>(node), threads);
  std::atomic<std::size_t> done{0};
  const std::size_t page = system_page();
  // Runs on another thread so that progress is reported from this one.
  auto work = std::async(std::launch::async, [&] {
    arena.parallel_for(chunks, [&](std::size_t first, std::size_t last) {
      for (std::size_t c = first; c < last; ++c) {
        const std::size_t begin = c * chunk;
        const std::size_t end = std::min(reserved, begin + chunk);
        // One write per page faults it in; the kernel hands out zeroed pages.
        for (std::size_t offset = begin; offset < end; offset += page) { base[offset] = std::byte{0}; }
        done.fetch_add(end - begin, std::memory_order_relaxed);
      }
    });
  });
  progress_reporter progress(options.on_progress, "prefault", reserved);
  while (work.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
    progress.report(done.load(std::memory_order_relaxed));
  }
  work.get();
  progress.report(reserved, true);
}

void pinned_arena::impl::lock()
{
  if (dev.kind() == backend_kind::emulated && !options.lock_pages) { return; }
  // One registration for the whole arena: CUDA resolves a host pointer to the one registration
  // holding it, so a copy spanning two (a slab across a chunk boundary, or torch copying a home
  // view) fails with cudaErrorInvalidValue. Seen on an H200: docs/gpu-results.md, 2026-11-26.
  progress_reporter progress(options.on_progress, "lock", reserved);
  progress.report(0);
  dev.backend().register_host(base, reserved);
  registrations.emplace_back(0, reserved);
  pinned = reserved;
  progress.report(pinned, true);
}

void pinned_arena::impl::release_registrations() noexcept
{
  for (const auto& [offset, bytes] : registrations) { dev.backend().unregister_host(base + offset, bytes); }
  registrations.clear();
  pinned = 0;
}

pinned_arena::impl::~impl()
{
  if (base != nullptr) {
    try {
      dev.synchronize();  // no queued copy may still read or write the pages (as cudaFreeHost)
    } catch (...) {  // teardown continues: the pages are unlocked and unmapped regardless
    }
  }
  release_registrations();
  if (base != nullptr) { ::munmap(base, reserved); }
}

pinned_arena::pinned_arena(const device& dev, pinned_arena_options options)
    : impl_(std::make_unique<impl>(dev, std::move(options)))
{
  auto& a = *impl_;
  const auto& t = detail::topology::instance();
  TASKSWAP_EXPECTS(a.options.bytes > 0, "pinned arena of 0 bytes; give it the bytes of the slabs it will hold");
  TASKSWAP_EXPECTS(a.options.chunk_bytes > 0, "pinned arena chunk_bytes must be positive");
  if (a.options.numa_node >= 0) {
    TASKSWAP_EXPECTS(t.has_node(static_cast<unsigned>(a.options.numa_node)),
                     detail::message("NUMA node ", a.options.numa_node, " does not exist; this machine has ",
                                     describe_topology().nodes.size(), " node(s), see taskswap probe"));
    a.node = static_cast<unsigned>(a.options.numa_node);
  } else {
    a.node = locality_of(dev).numa_nodes.front();
  }
  std::size_t node_memory = 0;
  for (const auto& n : t.nodes()) {
    if (n.os_index == a.node) { node_memory = n.memory_bytes; }
  }
  // On a machine of one node, that node is all of its memory: trust the OS's count where hwloc
  // reports less (a VM whose memory is hot-plugged: 5 GiB for node 0 of an H200 machine with 128
  // GiB, 2026-11-26). With several nodes the arena is bound to one, and its memory is the limit.
  if (t.nodes().size() == 1) {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    if (pages > 0) { node_memory = std::max(node_memory, static_cast<std::size_t>(pages) * system_page()); }
  }
  if (node_memory > 0 && a.options.bytes > node_memory) {
    throw out_of_memory(
      detail::message("pinned arena of ", detail::bytes_text(a.options.bytes), " does not fit in NUMA node ", a.node,
                      "'s ", detail::bytes_text(node_memory), " of memory"),
      a.options.bytes, node_memory, node_memory);
  }
  a.map_pages();
  a.bind();
  a.prefault();
  a.lock();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): alignment of real addresses
  a.slabs.emplace(a.reserved, reinterpret_cast<std::uintptr_t>(a.base));
}

pinned_arena::~pinned_arena() = default;
pinned_arena::pinned_arena(pinned_arena&&) noexcept = default;
pinned_arena& pinned_arena::operator=(pinned_arena&&) noexcept = default;

std::span<std::byte> pinned_arena::allocate(std::size_t bytes, std::size_t alignment)
{
  TASKSWAP_EXPECTS(bytes > 0, "pinned_arena::allocate of 0 bytes");
  TASKSWAP_EXPECTS(is_power_of_two(alignment) && alignment >= 256,
                   detail::message("slab alignment must be a power of two of at least 256, got ", alignment));
  auto& a = *impl_;
  const std::lock_guard lock(a.mutex);
  if (const auto offset = a.slabs->allocate(bytes, alignment)) { return {a.base + *offset, bytes}; }
  throw out_of_memory(
    detail::message("pinned arena on node ", a.node, ": no free block holds ", detail::bytes_text(bytes),
                    " aligned to ", alignment, "; ", detail::bytes_text(a.reserved - a.slabs->used()), " free in ",
                    a.slabs->free_blocks(), " block(s), the largest ", detail::bytes_text(a.slabs->largest_free()),
                    ", of ", detail::bytes_text(a.reserved), "; free slabs first or make the arena larger"),
    bytes, a.reserved - a.slabs->used(), a.reserved);
}

void pinned_arena::deallocate(std::span<std::byte> slab)
{
  auto& a = *impl_;
  const std::lock_guard lock(a.mutex);
  const bool inside = slab.data() >= a.base && slab.data() < a.base + a.reserved;
  TASKSWAP_EXPECTS(inside && a.slabs->deallocate(static_cast<std::size_t>(slab.data() - a.base), slab.size()),
                   detail::message("pinned_arena::deallocate: ", slab.size(), " bytes at ",
                                   static_cast<const void*>(slab.data()), " is not a live slab of this arena"));
}

pinned_arena_stats pinned_arena::stats() const
{
  const auto& a = *impl_;
  const std::lock_guard lock(a.mutex);
  return {a.reserved, a.slabs->used(), a.pinned, a.slabs->largest_free(), a.slabs->live()};
}

unsigned pinned_arena::numa_node() const noexcept { return impl_->node; }
bool pinned_arena::bound() const noexcept { return impl_->bound; }
bool pinned_arena::locked() const noexcept { return impl_->pinned == impl_->reserved; }
std::span<std::byte> pinned_arena::memory() const noexcept { return {impl_->base, impl_->reserved}; }
const device& pinned_arena::get_device() const noexcept { return impl_->dev; }

}  // namespace taskswap
