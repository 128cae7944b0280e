// SPDX-License-Identifier: Apache-2.0
// Storage benchmarks: the disk home tier's unit files against fio on the same drive.
//
// storage_io/<read|write>/<file MiB>/<block KiB>/<queue depth>/<ring>: one unit file of that size
//   read (or written) through storage/unit_files.hpp (io_uring, O_DIRECT, the memory registered
//   with the ring), each iteration a whole pass: ring 0 as the tier moves a unit, one transfer
//   between the file and a buffer as large as it; ring 1 as fio moves it, block by block through
//   `depth` buffers reused in turn (on a drive the two cost alike; on tmpfs, where the copy is the
//   CPU's, fio's few buffers stay in cache and the whole-unit pass cannot, so compare ring 1 there). Measured in the same iterations, on the same
//   file, taking turns with ours (the order alternating), as the anchor:
//     fio_GBps   Debian's fio with the same file size, block size and queue depth, ioengine
//                io_uring, direct=1, fixedbufs (the same kind of requests: an upper bound that
//                shares no code with ours), one pass per iteration;
//     GBps       ours; fio_ratio = the median of the per-iteration ratios GBps / fio_GBps
//                (target >= 0.9 both ways). GBps and fio_GBps are medians too.
//   The label names the directory's file system and whether O_DIRECT took. The directory is
//   TASKSWAP_BENCH_STORAGE_DIR (a directory on the drive to judge), else the system's temporary
//   directory; the files are removed afterwards. Without fio on PATH the rows are skipped.
//
// host_cache_touch/<entries>: the host cache's bookkeeping per touch as the number of disk homes
//   grows and the cache does not: `entries` homes of 4 KiB (files in the system's temporary
//   directory) behind a cache of 32 blocks, touched as the runtime touches them over a fixed
//   random schedule of 48 of them (the same in every row, so the reads and writes are too):
//   pump(), a read ahead of the home used two touches later, block() of this one, written on
//   the host (used()). The cache looks only at the entries that have a block, so the time per
//   touch (per iteration) should stay flat across the rows; when it looked at every entry,
//   10,000 homes cost 5.7 % of the sample's CPU time. No anchor: the rows are compared with
//   each other.

#include "storage/host_cache.hpp"
#include "storage/unit_files.hpp"

#include <taskswap/device.hpp>
#include <taskswap/error.hpp>

#include <benchmark/benchmark.h>

#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = KiB * KiB;

fs::path bench_directory()
{
  const char* dir = std::getenv("TASKSWAP_BENCH_STORAGE_DIR");
  const fs::path base = dir != nullptr && *dir != '\0' ? fs::path(dir) : fs::temp_directory_path();
  return base / ("taskswap-storage-bench-" + std::to_string(::getpid()));
}

std::string file_system(const fs::path& dir)
{
  struct statfs s {};
  if (::statfs(dir.c_str(), &s) != 0) { return "unknown"; }
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlay";
    default: {
      std::ostringstream out;
      out << "fs 0x" << std::hex << static_cast<unsigned long>(s.f_type);
      return out.str();
    }
  }
}

// fio's bandwidth in bytes/s for one job like ours; 0 when fio is missing or fails.
double fio_bytes_per_second(const fs::path& file, bool write, std::size_t bytes, std::size_t block, unsigned depth)
{
  std::ostringstream cmd;
  cmd << "fio --name=anchor --filename=" << file.string() << " --size=" << bytes << " --bs=" << block
      << " --iodepth=" << depth << " --ioengine=io_uring --direct=1 --fixedbufs --rw=" << (write ? "write" : "read")
      << " --output-format=terse 2>/dev/null";
  FILE* pipe = ::popen(cmd.str().c_str(), "r");
  if (pipe == nullptr) { return 0; }
  std::string out;
  char chunk[4096];
  while (std::fgets(chunk, sizeof chunk, pipe) != nullptr) { out += chunk; }
  if (::pclose(pipe) != 0) { return 0; }
  // Terse version 3: field 7 is the read bandwidth, field 48 the write bandwidth, in KiB/s.
  std::vector<std::string> fields;
  std::istringstream in(out.substr(0, out.find('\n')));
  for (std::string f; std::getline(in, f, ';');) { fields.push_back(f); }
  const std::size_t at = write ? 47 : 6;
  return fields.size() > at ? std::stod(fields[at]) * 1024.0 : 0.0;
}

struct aligned_free {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One pass over the file a block at a time through `ring` (depth blocks, reused in turn, as fio's
// buffers are), `depth` blocks in flight.
void pass_through_ring(taskswap::detail::unit_files& files, taskswap::detail::unit_files::file_index f,
                       std::span<std::byte> ring, std::size_t bytes, std::size_t block, bool write)
{
  const std::size_t places = ring.size() / block;
  std::vector<taskswap::detail::unit_files::transfer> flight(places);
  const std::size_t blocks = bytes / block;
  for (std::size_t k = 0; k < blocks; ++k) {
    const std::span<std::byte> place = ring.subspan((k % places) * block, block);
    if (k >= places) { files.wait(flight[k % places]); }
    flight[k % places] = write ? files.write(f, k * block, place) : files.read(f, k * block, place);
  }
  for (std::size_t k = blocks > places ? blocks - places : 0; k < blocks; ++k) { files.wait(flight[k % places]); }
}

void storage_io(benchmark::State& state)
{
  const bool write = state.range(0) == 1;
  const auto bytes = static_cast<std::size_t>(state.range(1)) * MiB;
  const auto block = static_cast<std::size_t>(state.range(2)) * KiB;
  const auto depth = static_cast<unsigned>(state.range(3));
  const bool ring = state.range(4) == 1;
  const fs::path dir = bench_directory();
  std::unique_ptr<std::byte, aligned_free> buffer(static_cast<std::byte*>(std::aligned_alloc(4096, bytes)));
  const std::span<std::byte> memory(buffer.get(), bytes);
  for (std::size_t i = 0; i < bytes; i += 4096) { memory[i] = static_cast<std::byte>(i / 4096); }
  std::vector<double> ours;
  std::vector<double> anchor;
  std::vector<double> ratios;
  bool direct = false;
  {
    taskswap::detail::unit_files files({.directory = dir, .queue_depth = depth, .block_bytes = block});
    files.register_buffers(memory);
    direct = files.direct();
    const auto f = files.open("bench/unit", 1, bytes);
    files.wait(files.write(f, 0, memory));  // the file's blocks exist before a read pass
    // The two take turns on the same file, the order alternating, so that a drive (or a virtual
    // disk's host) whose speed drifts judges both alike; the ratio is taken within each turn.
    bool fio_first = false;
    for (auto _ : state) {
      double fio = 0;
      if (fio_first) { fio = fio_bytes_per_second(files.path(f), write, bytes, block, depth); }
      const auto start = std::chrono::steady_clock::now();
      if (ring) {
        pass_through_ring(files, f, memory.first(std::size_t{depth} * block), bytes, block, write);
      } else {
        files.wait(write ? files.write(f, 0, memory) : files.read(f, 0, memory));
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!fio_first) { fio = fio_bytes_per_second(files.path(f), write, bytes, block, depth); }
      fio_first = !fio_first;
      if (fio <= 0) {
        state.SkipWithError("fio is not on PATH or failed (apt-get install fio)");
        break;
      }
      state.SetIterationTime(s);
      ours.push_back(static_cast<double>(bytes) / s);
      anchor.push_back(fio);
      ratios.push_back(ours.back() / fio);
    }
  }
  fs::remove_all(dir);
  if (ours.empty()) { return; }
  state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(ours.size() * bytes)));
  state.counters["GBps"] = median(ours) / 1e9;
  state.counters["fio_GBps"] = median(anchor) / 1e9;
  state.counters["fio_ratio"] = median(ratios);
  state.SetLabel(file_system(dir.parent_path()) + (direct ? ", O_DIRECT" : ", buffered"));
}

void storage_io_rows(benchmark::internal::Benchmark* b)
{
  // File sizes that are not powers of two; the block sizes DeepSpeed's aio and ours default to.
  for (const int write : {0, 1}) {
    for (const auto& [mib, kib] :
         {std::pair{96, 1024}, std::pair{352, 1024}, std::pair{352, 256}, std::pair{1000, 1024}}) {
      b->Args({write, mib, kib, 8, 0});
    }
    b->Args({write, 352, 1024, 2, 0});
    b->Args({write, 352, 1024, 8, 1});
  }
}

void host_cache_touch(benchmark::State& state)
{
  using taskswap::detail::host_cache;
  const auto entries = static_cast<std::uint32_t>(state.range(0));
  constexpr std::size_t home = 4 * KiB;
  constexpr std::size_t blocks = 32;
  constexpr std::size_t touches = 4096;
  const fs::path dir = bench_directory();
  std::unique_ptr<std::byte, aligned_free> buffer(static_cast<std::byte*>(std::aligned_alloc(4096, blocks * home)));
  std::vector<std::uint32_t> schedule(touches);
  std::mt19937 rng(7);
  for (std::uint32_t& e : schedule) { e = static_cast<std::uint32_t>(rng() % 48); }
  std::vector<std::vector<std::uint64_t>> uses(entries);  // each entry's positions in the schedule
  for (std::size_t k = 0; k < touches; ++k) { uses[schedule[k]].push_back(k); }
  std::size_t now = 0;
  try {
    taskswap::detail::unit_files files({.directory = dir});
    host_cache cache(taskswap::emulated_device(), {buffer.get(), blocks * home}, files);
    for (std::uint32_t e = 0; e < entries; ++e) { (void)cache.add("bench/" + std::to_string(e), 1, home); }
    cache.next_use([&](host_cache::entry_id e) {
      const auto& q = uses[e];
      const auto it = std::upper_bound(q.begin(), q.end(), now % touches);
      return it == q.end() ? host_cache::never : *it;
    });
    for (auto _ : state) {
      cache.pump();
      (void)cache.prefetch(schedule[(now + 2) % touches]);
      const std::uint32_t e = schedule[now % touches];
      benchmark::DoNotOptimize(cache.block(e)[0] = std::byte{1});
      cache.used(e, nullptr, true);
      ++now;
    }
    cache.flush();
  } catch (const taskswap::storage_error& e) {  // e.g. the open-file limit (Note [Open files])
    state.SkipWithError(e.what());
  }
  fs::remove_all(dir);
}
}  // namespace

BENCHMARK(host_cache_touch)->Arg(48)->Arg(1000)->Arg(10000)->ArgName("entries")->Unit(benchmark::kMicrosecond);

BENCHMARK(storage_io)
  ->Apply(storage_io_rows)
  ->ArgNames({"write", "MiB", "block_KiB", "depth", "ring"})
  ->UseManualTime()
  ->Unit(benchmark::kMillisecond)
  ->Iterations(6);
