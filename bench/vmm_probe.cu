// SPDX-License-Identifier: Apache-2.0
// vmm_probe: what CUDA's virtual-memory calls cost a thread, split by call, and whether they can
// leave the trainer's thread. Prints one table per question:
//  1. each call's host time (cuMemMap per granule, one cuMemSetAccess over the range, cuMemUnmap
//     per granule or over the range) at 1 … 96 granules, the device idle;
//  2. the same with a 1 GiB copy in flight;
//  3. a granule mapped at a second address while the first mapping stays (and the data seen there);
//  4. mapping threads at once: the MiB moved per second by 1, 2, 4 and 8 threads;
//  5. the host time of a trainer-like loop of cudaMemcpyAsync + cudaEventRecord +
//     cudaStreamWaitEvent, alone and while a second thread maps;
//  6. whether a copy may be queued to an address that is mapped only before the copy runs;
//  (cuMemMap at an offset into a handle is refused by driver 580: CUDA_ERROR_NOT_SUPPORTED)
//  8. whether the calls wait for a kernel or a host function in flight on another stream;
//  9. what cuMemCreate and cuMemRelease cost for a handle of 1 … 96 granules.
// Arguments: [device index] [sections, e.g. 17; default all]
// Built as build/<preset>/bench/vmm_probe where CUDA is on; run: vmm_probe [device] [sections]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

void check(CUresult r, const char* what, int line)
{
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    cuGetErrorName(r, &name);
    std::fprintf(stderr, "vmm_probe: %s failed (%s) at line %d\n", what, name ? name : "?", line);
    std::exit(1);
  }
}
void check(cudaError_t r, const char* what, int line)
{
  if (r != cudaSuccess) {
    std::fprintf(stderr, "vmm_probe: %s failed (%s) at line %d\n", what, cudaGetErrorName(r), line);
    std::exit(1);
  }
}
#define TRY(call) check((call), #call, __LINE__)

double us_since(clock_type::time_point t0)
{
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double quantile(std::vector<double> v, double q)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<std::size_t>(q * v.size()))];
}

__global__ void spin(long long cycles)
{
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}

int dev_index = 0;
std::size_t g = 0;  // granule

CUmemAllocationProp prop_of()
{
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev_index;
  return p;
}

void grant(CUdeviceptr va, std::size_t bytes)
{
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = dev_index;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TRY(cuMemSetAccess(va, bytes, &a, 1));
}

struct split {
  double map = 0, access = 0, unmap = 0;
};

// One move of n granules at va: map each, grant once, unmap each (or once over the range).
split move_once(CUdeviceptr va, const std::vector<CUmemGenericAllocationHandle>& h, std::size_t first, std::size_t n,
                bool unmap_whole)
{
  split s;
  auto t = clock_type::now();
  for (std::size_t i = 0; i < n; ++i) { TRY(cuMemMap(va + i * g, g, 0, h[first + i], 0)); }
  s.map = us_since(t);
  t = clock_type::now();
  grant(va, n * g);
  s.access = us_since(t);
  t = clock_type::now();
  if (unmap_whole) {
    TRY(cuMemUnmap(va, n * g));
  } else {
    for (std::size_t i = 0; i < n; ++i) { TRY(cuMemUnmap(va + i * g, g)); }
  }
  s.unmap = us_since(t);
  return s;
}

void table_split(const char* title, CUdeviceptr va, const std::vector<CUmemGenericAllocationHandle>& h,
                 bool unmap_whole, int reps)
{
  std::printf("\n%s\n", title);
  std::printf("%8s %10s %12s %12s %12s %12s %12s\n", "granules", "MiB", "map us", "access us", "unmap us", "total us",
              "us per MiB");
  for (const std::size_t n : {1, 8, 32, 96}) {
    std::vector<double> m, a, u;
    for (int r = 0; r < reps; ++r) {
      // Rotate over the handles so each turn maps granules the last turn did not.
      const std::size_t first = (static_cast<std::size_t>(r) * n) % (h.size() - n + 1);
      const split s = move_once(va, h, first, n, unmap_whole);
      m.push_back(s.map), a.push_back(s.access), u.push_back(s.unmap);
    }
    const double total = median(m) + median(a) + median(u);
    const double mib = static_cast<double>(n * g) / (1 << 20);
    std::printf("%8zu %10.0f %12.1f %12.1f %12.1f %12.1f %12.2f\n", n, mib, median(m), median(a), median(u), total,
                total / mib);
  }
}

}  // namespace

int main(int argc, char** argv)
{
  if (argc > 1) { dev_index = std::atoi(argv[1]); }
  const char* sections = argc > 2 ? argv[2] : "123456789";
  const auto want = [&](char c) { return std::strchr(sections, c) != nullptr; };
  TRY(cudaSetDevice(dev_index));
  TRY(cudaFree(nullptr));  // the primary context, current on this thread
  CUcontext ctx = nullptr;
  TRY(cuCtxGetCurrent(&ctx));
  cudaDeviceProp props{};
  TRY(cudaGetDeviceProperties(&props, dev_index));
  int driver = 0;
  TRY(cudaDriverGetVersion(&driver));
  const CUmemAllocationProp prop = prop_of();
  std::size_t rec = 0;
  TRY(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  TRY(cuMemGetAllocationGranularity(&rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  std::printf("vmm_probe: %s, driver %d, granule %zu KiB (recommended %zu KiB), %u copy engines\n", props.name, driver,
              g >> 10, rec >> 10, props.asyncEngineCount);

  constexpr std::size_t handles = 512;  // 1 GiB of 2 MiB granules
  std::vector<CUmemGenericAllocationHandle> h(handles);
  for (auto& x : h) { TRY(cuMemCreate(&x, g, &prop, 0)); }
  CUdeviceptr va = 0;
  TRY(cuMemAddressReserve(&va, 128 * g, g, 0, 0));

  // 1. idle
  if (want('1')) {
    table_split("1a. one move, device idle (map per granule, one grant, unmap per granule)", va, h, false, 21);
    table_split("1b. the same, unmap over the whole range in one call", va, h, true, 21);

    // 1c. a run of granules as one handle: one cuMemMap, one grant, one unmap.
  }
  if (want('1')) {
    std::printf("\n1c. one handle of n granules: one map, one grant, one unmap\n");
    std::printf("%8s %12s %12s %12s %12s\n", "granules", "map us", "access us", "unmap us", "us per MiB");
    for (const std::size_t n : {8, 32, 96}) {
      CUmemGenericAllocationHandle big{};
      TRY(cuMemCreate(&big, n * g, &prop, 0));
      std::vector<double> m, a, u;
      for (int r = 0; r < 21; ++r) {
        auto t = clock_type::now();
        TRY(cuMemMap(va, n * g, 0, big, 0));
        m.push_back(us_since(t));
        t = clock_type::now();
        grant(va, n * g);
        a.push_back(us_since(t));
        t = clock_type::now();
        TRY(cuMemUnmap(va, n * g));
        u.push_back(us_since(t));
      }
      TRY(cuMemRelease(big));
      const double mib = static_cast<double>(n * g) / (1 << 20);
      std::printf("%8zu %12.1f %12.1f %12.1f %12.2f\n", n, median(m), median(a), median(u),
                  (median(m) + median(a) + median(u)) / mib);
    }
  }

  // 2. with a 1 GiB copy in flight (pinned host to a plain device allocation), on its own stream.
  if (want('2')) {
    void* host = nullptr;
    void* dbuf = nullptr;
    const std::size_t big = std::size_t{1} << 30;
    TRY(cudaHostAlloc(&host, big, cudaHostAllocDefault));
    std::memset(host, 1, big);
    TRY(cudaMalloc(&dbuf, big));
    cudaStream_t s{};
    TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::printf("\n2. one move with a 1 GiB H2D copy in flight\n");
    std::printf("%8s %12s %12s %12s %12s %14s\n", "granules", "map us", "access us", "unmap us", "us per MiB",
                "copy running");
    for (const std::size_t n : {1, 32, 96}) {
      std::vector<double> m, a, u;
      int running = 0;
      for (int r = 0; r < 9; ++r) {
        TRY(cudaMemcpyAsync(dbuf, host, big, cudaMemcpyHostToDevice, s));
        const split sp = move_once(va, h, (static_cast<std::size_t>(r) * n) % (handles - n + 1), n, false);
        running += cudaStreamQuery(s) == cudaErrorNotReady ? 1 : 0;
        TRY(cudaStreamSynchronize(s));
        m.push_back(sp.map), a.push_back(sp.access), u.push_back(sp.unmap);
      }
      const double mib = static_cast<double>(n * g) / (1 << 20);
      std::printf("%8zu %12.1f %12.1f %12.1f %12.2f %11d/9\n", n, median(m), median(a), median(u),
                  (median(m) + median(a) + median(u)) / mib, running);
    }
    TRY(cudaStreamDestroy(s));
    TRY(cudaFree(dbuf));
    TRY(cudaFreeHost(host));
  }

  // 3. a second mapping of granules that stay mapped at the first address.
  if (want('3')) {
    CUdeviceptr va2 = 0;
    TRY(cuMemAddressReserve(&va2, 32 * g, g, 0, 0));
    const std::size_t n = 32;
    std::vector<double> m, a, u, m2, a2;
    bool same = true;
    std::vector<unsigned char> in(n * g), out(n * g);
    for (std::size_t i = 0; i < in.size(); ++i) { in[i] = static_cast<unsigned char>(i * 2654435761u >> 24); }
    for (int r = 0; r < 9; ++r) {
      for (std::size_t i = 0; i < n; ++i) { TRY(cuMemMap(va + i * g, g, 0, h[i], 0)); }
      grant(va, n * g);
      if (r == 0) { TRY(cuMemcpyHtoD(va, in.data(), n * g)); }
      auto t = clock_type::now();
      for (std::size_t i = 0; i < n; ++i) { TRY(cuMemMap(va2 + i * g, g, 0, h[i], 0)); }
      m2.push_back(us_since(t));
      t = clock_type::now();
      grant(va2, n * g);
      a2.push_back(us_since(t));
      t = clock_type::now();
      for (std::size_t i = 0; i < n; ++i) { TRY(cuMemUnmap(va + i * g, g)); }
      u.push_back(us_since(t));
      if (r == 0) {
        TRY(cuMemcpyDtoH(out.data(), va2, n * g));
        same = std::memcmp(in.data(), out.data(), in.size()) == 0;
      }
      for (std::size_t i = 0; i < n; ++i) { TRY(cuMemUnmap(va2 + i * g, g)); }
    }
    std::printf("\n3. 32 granules mapped at a second address while mapped at the first: map %.1f us, grant %.1f us; "
                "then unmapping the first %.1f us; the data seen at the second address %s\n",
                median(m2), median(a2), median(u), same ? "equal" : "DIFFERENT");
    TRY(cuMemAddressFree(va2, 32 * g));
  }

  // 4. threads mapping at once, each its own addresses and granules.
  if (want('4')) {
    std::printf("\n4. mapping threads at once (moves of 16 granules, 0.4 s)\n%8s %14s %14s\n", "threads", "MiB moved/s",
                "per thread");
    for (const int k : {1, 2, 4, 8}) {
      std::atomic<bool> stop{false};
      std::atomic<std::size_t> moved{0};
      std::vector<CUdeviceptr> vas(k);
      for (auto& x : vas) { TRY(cuMemAddressReserve(&x, 16 * g, g, 0, 0)); }
      std::vector<std::thread> ts;
      for (int i = 0; i < k; ++i) {
        ts.emplace_back([&, i] {
          TRY(cuCtxSetCurrent(ctx));
          std::size_t turn = 0;
          while (!stop.load()) {
            const std::size_t first = static_cast<std::size_t>(i) * 64 + (turn++ % 4) * 16;
            static_cast<void>(move_once(vas[i], h, first, 16, false));
            moved += 16;
          }
        });
      }
      const auto t0 = clock_type::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      stop = true;
      for (auto& t : ts) { t.join(); }
      const double s = us_since(t0) / 1e6;
      const double mib = static_cast<double>(moved.load() * g) / (1 << 20) / s;
      std::printf("%8d %14.0f %14.0f\n", k, mib, mib / k);
      for (auto& x : vas) { TRY(cuMemAddressFree(x, 16 * g)); }
    }
  }

  // 5. a trainer-like loop on this thread, alone and while a second thread maps.
  if (want('5')) {
    void* host = nullptr;
    void* dbuf = nullptr;
    TRY(cudaHostAlloc(&host, 1 << 16, cudaHostAllocDefault));
    TRY(cudaMalloc(&dbuf, 1 << 16));
    cudaStream_t s1{}, s2{};
    TRY(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    TRY(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t e{};
    TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::printf("\n5. a loop of cudaMemcpyAsync(4 KiB) + cudaEventRecord + cudaStreamWaitEvent, host us per turn\n");
    std::printf("%28s %10s %10s %10s %10s\n", "", "median", "p90", "p99", "max");
    for (const int mappers : {0, 1, 0, 1}) {
      std::atomic<bool> stop{false};
      std::thread bg;
      CUdeviceptr bva = 0;
      if (mappers > 0) {
        TRY(cuMemAddressReserve(&bva, 32 * g, g, 0, 0));
        bg = std::thread([&] {
          TRY(cuCtxSetCurrent(ctx));
          std::size_t turn = 0;
          while (!stop.load()) { static_cast<void>(move_once(bva, h, (turn++ % 8) * 32, 32, false)); }
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      std::vector<double> lat;
      for (int i = 0; i < 20000; ++i) {
        const auto t = clock_type::now();
        TRY(cudaMemcpyAsync(dbuf, host, 4096, cudaMemcpyHostToDevice, s1));
        TRY(cudaEventRecord(e, s1));
        TRY(cudaStreamWaitEvent(s2, e, 0));
        lat.push_back(us_since(t));
        if (i % 256 == 255) { TRY(cudaStreamSynchronize(s2)); }
      }
      stop = true;
      if (bg.joinable()) { bg.join(); }
      if (bva != 0) { TRY(cuMemAddressFree(bva, 32 * g)); }
      TRY(cudaStreamSynchronize(s2));
      std::printf("%28s %10.2f %10.2f %10.2f %10.1f\n", mappers ? "a thread mapping beside it" : "alone", median(lat),
                  quantile(lat, 0.9), quantile(lat, 0.99), quantile(lat, 1.0));
    }
    TRY(cudaEventDestroy(e));
    TRY(cudaStreamDestroy(s1));
    TRY(cudaStreamDestroy(s2));
    TRY(cudaFree(dbuf));
    TRY(cudaFreeHost(host));
  }

  // 6. a copy queued to addresses that are mapped only after it was queued, before it runs.
  if (want('6')) {
    void* host = nullptr;
    const std::size_t n = 4;
    TRY(cudaHostAlloc(&host, n * g, cudaHostAllocDefault));
    std::memset(host, 7, n * g);
    cudaStream_t s{};
    TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::atomic<bool> go{false};
    TRY(cudaLaunchHostFunc(
      s,
      [](void* p) {
        while (!static_cast<std::atomic<bool>*>(p)->load()) { std::this_thread::yield(); }
      },
      &go));
    // NOLINTNEXTLINE(performance-no-int-to-ptr)
    const cudaError_t queued = cudaMemcpyAsync(reinterpret_cast<void*>(va), host, n * g, cudaMemcpyHostToDevice, s);
    for (std::size_t i = 0; i < n; ++i) { TRY(cuMemMap(va + i * g, g, 0, h[i], 0)); }
    grant(va, n * g);
    go = true;
    const cudaError_t ran = cudaStreamSynchronize(s);
    std::vector<unsigned char> out(n * g, 0);
    bool ok = false;
    if (queued == cudaSuccess && ran == cudaSuccess) {
      TRY(cuMemcpyDtoH(out.data(), va, n * g));
      ok = std::all_of(out.begin(), out.end(), [](unsigned char c) { return c == 7; });
    }
    std::printf("\n6. a copy queued before its destination was mapped: queue %s, run %s, data %s\n",
                cudaGetErrorName(queued), cudaGetErrorName(ran), ok ? "arrived" : "did not arrive");
    static_cast<void>(cudaGetLastError());
    for (std::size_t i = 0; i < n; ++i) { static_cast<void>(cuMemUnmap(va + i * g, g)); }
    static_cast<void>(cudaStreamDestroy(s));
    static_cast<void>(cudaFreeHost(host));
  }

  // 8. the calls while a kernel (or a host function) holds another stream for about 20 ms.
  if (want('8')) {
    cudaStream_t s{};
    TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int clock_khz = 0;
    TRY(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev_index));
    CUmemGenericAllocationHandle big{};
    TRY(cuMemCreate(&big, 32 * g, &prop, 0));
    std::printf("\n8. one move while another stream is busy for 20 ms (us; 'running' = still busy after the move)\n");
    std::printf("%22s %24s %10s %10s %10s %8s\n", "busy with", "move", "map", "access", "unmap", "running");
    for (const int what : {0, 1, 2}) {
      for (const int kind : {0, 1}) {
        std::vector<double> m, a, u;
        int running = 0;
        for (int r = 0; r < 5; ++r) {
          if (what == 1) {
            spin<<<1, 1, 0, s>>>(static_cast<long long>(clock_khz) * 20);
            TRY(cudaGetLastError());
          } else if (what == 2) {
            TRY(cudaLaunchHostFunc(
              s, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }, nullptr));
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          split sp;
          if (kind == 0) {
            sp = move_once(va, h, static_cast<std::size_t>(r) * 32, 32, false);
          } else {
            auto t = clock_type::now();
            TRY(cuMemMap(va, 32 * g, 0, big, 0));
            sp.map = us_since(t);
            t = clock_type::now();
            grant(va, 32 * g);
            sp.access = us_since(t);
            t = clock_type::now();
            TRY(cuMemUnmap(va, 32 * g));
            sp.unmap = us_since(t);
          }
          running += cudaStreamQuery(s) == cudaErrorNotReady ? 1 : 0;
          TRY(cudaStreamSynchronize(s));
          m.push_back(sp.map), a.push_back(sp.access), u.push_back(sp.unmap);
        }
        std::printf("%22s %24s %10.1f %10.1f %10.1f %6d/5\n",
                    what == 0   ? "nothing"
                    : what == 1 ? "a kernel"
                                : "a host function",
                    kind == 0 ? "32 handles of a granule" : "one handle of 32", median(m), median(a), median(u),
                    running);
      }
    }
    TRY(cuMemRelease(big));
    TRY(cudaStreamDestroy(s));
  }

  // 9. creating and releasing handles.
  if (want('9')) {
    std::printf("\n9. cuMemCreate / cuMemRelease of one handle (us)\n%8s %10s %10s\n", "granules", "create", "release");
    for (const std::size_t n : {1, 8, 32, 96}) {
      std::vector<double> c, r;
      for (int k = 0; k < 9; ++k) {
        CUmemGenericAllocationHandle x{};
        auto t = clock_type::now();
        TRY(cuMemCreate(&x, n * g, &prop, 0));
        c.push_back(us_since(t));
        t = clock_type::now();
        TRY(cuMemRelease(x));
        r.push_back(us_since(t));
      }
      std::printf("%8zu %10.1f %10.1f\n", n, median(c), median(r));
    }
  }

  TRY(cuMemAddressFree(va, 128 * g));
  for (auto x : h) { TRY(cuMemRelease(x)); }
  std::printf("\nvmm_probe: done\n");
  return 0;
}
