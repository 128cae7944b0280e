// SPDX-License-Identifier: Apache-2.0
#include "device/cuda/cuda_backend.hpp"

#include "device/cuda/cuda_device_guard.hpp"
#include "device/cuda/cuda_try.hpp"
#include "device/message.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>
#include <array>
#include <cassert>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace taskswap::detail {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line)
{
  static_cast<void>(cudaGetLastError());  // clear a non-sticky error so later calls start clean
  throw cuda_error(message("taskswap: CUDA call ", call, " failed at ", file, ":", line, ": ", cudaGetErrorName(status),
                           " (", cudaGetErrorString(status), ")"));
}

void report_cuda_error(cudaError_t status, const char* call, const char* file, int line) noexcept
{
  static_cast<void>(cudaGetLastError());
  std::fprintf(stderr, "taskswap: CUDA call %s failed at %s:%d during teardown: %s (%s)\n", call, file, line,
               cudaGetErrorName(status), cudaGetErrorString(status));
  assert(false && "CUDA call failed during teardown");
}

namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// The legacy and per-thread default streams (an external_stream of 0) resolve against the calling
// thread's current device: operations on them make the backend's device current for their duration.
class implicit_stream_guard {
 public:
  implicit_stream_guard(void* s, int index)
  {
    if (as_stream(s) == cudaStreamLegacy || as_stream(s) == cudaStreamPerThread) { guard_.emplace(index); }
  }

 private:
  std::optional<cuda_device_guard> guard_;
};
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

cudaMemcpyKind kind_of(copy_direction direction)
{
  switch (direction) {
    case copy_direction::host_to_device: return cudaMemcpyHostToDevice;
    case copy_direction::device_to_host: return cudaMemcpyDeviceToHost;
    case copy_direction::device_to_device: return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

// A host function travelling through cudaLaunchHostFunc; deleted by the trampoline.
struct host_func_payload {
  std::shared_ptr<host_func_errors> errors;  // outlives the stream and the backend if need be
  std::function<void()> fn;
};

void CUDART_CB host_func_trampoline(void* user_data)
{
  std::unique_ptr<host_func_payload> payload(static_cast<host_func_payload*>(user_data));
  run_host_func(*payload->errors, payload->fn);
}

// The driver's virtual memory calls, found through the runtime (cudaGetDriverEntryPointByVersion),
// so that libtaskswap loads on machines without a driver, where cuda_device_count() is 0.
struct driver_vm {
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;

  static const driver_vm& get()
  {
    static const driver_vm vm = [] {
      driver_vm d;
      const auto find = [](const char* symbol, auto& fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found{};
        TASKSWAP_CUDA_TRY(cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || p == nullptr) {
          throw cuda_error(message("the CUDA driver has no ", symbol,
                                   "; the device pool needs a driver with "
                                   "virtual memory management (CUDA 12 or later)"));
        }
        // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the driver's own type
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      };
      find("cuGetErrorName", d.get_error_name);
      find("cuMemGetAllocationGranularity", d.granularity);
      find("cuMemCreate", d.create);
      find("cuMemRelease", d.release);
      find("cuMemAddressReserve", d.reserve);
      find("cuMemAddressFree", d.free);
      find("cuMemMap", d.map);
      find("cuMemSetAccess", d.set_access);
      find("cuMemUnmap", d.unmap);
      find("cuDeviceGet", d.device_get);
      find("cuDeviceGetAttribute", d.attribute);
      return d;
    }();
    return vm;
  }

  // `what` says what was being done; a callable is called only on failure (no text is built per
  // granule on the mapping path).
  template <typename What>
  void check(CUresult status, const char* call, const What& what) const
  {
    if (status == CUDA_SUCCESS) [[likely]] { return; }
    const char* name = "unknown";
    static_cast<void>(get_error_name(status, &name));
    std::string context;
    if constexpr (std::is_invocable_v<What>) {
      context = what();
    } else {
      context = what;
    }
    if (status == CUDA_ERROR_OUT_OF_MEMORY) {
      throw out_of_memory(message(context, ": ", call, " failed: ", name), 0, 0, 0);
    }
    throw cuda_error(message("taskswap: CUDA driver call ", call, " failed (", context, "): ", name));
  }
};

#define TASKSWAP_CU_TRY(vm, call, what) (vm).check((call), #call, (what))

CUmemAllocationProp device_memory_on(int index)
{
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = index;
  return prop;
}

class cuda_backend final : public backend {
 public:
  explicit cuda_backend(int index) : index_(index)
  {
    cudaDeviceProp properties{};
    TASKSWAP_CUDA_TRY(cudaGetDeviceProperties(&properties, index));
    name_ = properties.name;
  }

  [[nodiscard]] backend_kind kind() const noexcept override { return backend_kind::cuda; }
  [[nodiscard]] int index() const noexcept override { return index_; }
  [[nodiscard]] std::string name() const override { return name_; }

  [[nodiscard]] memory_info memory() const override
  {
    const cuda_device_guard guard(index_);
    memory_info info;
    TASKSWAP_CUDA_TRY(cudaMemGetInfo(&info.free, &info.total));
    return info;
  }

  [[nodiscard]] std::pair<int, int> stream_priority_range() const override
  {
    const cuda_device_guard guard(index_);
    int least = 0;
    int greatest = 0;
    TASKSWAP_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    return {least, greatest};
  }

  [[nodiscard]] std::string pci_bus_id() const override
  {
    std::array<char, 32> id{};
    TASKSWAP_CUDA_TRY(cudaDeviceGetPCIBusId(id.data(), static_cast<int>(id.size()), index_));
    return id.data();
  }

  void register_host(void* p, std::size_t bytes) override
  {
    const cuda_device_guard guard(index_);
    const cudaError_t status = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (status == cudaErrorMemoryAllocation) {
      static_cast<void>(cudaGetLastError());
      throw out_of_memory(message("cuda:", index_, ": cannot page-lock ", bytes_text(bytes),
                                  " of host memory (cudaHostRegister: ", cudaGetErrorName(status),
                                  "); lower the arena size or raise the locked-memory limit"),
                          bytes, 0, 0);
    }
    TASKSWAP_CUDA_TRY(status);
  }

  void unregister_host(void* p, std::size_t /*bytes*/) noexcept override
  {
    TASKSWAP_ASSERT_CUDA_SUCCESS(cudaHostUnregister(p));
  }

  void synchronize() override
  {
    const cuda_device_guard guard(index_);
    TASKSWAP_CUDA_TRY(cudaDeviceSynchronize());
  }

  [[nodiscard]] std::byte* allocate(std::size_t bytes) override
  {
    const cuda_device_guard guard(index_);
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaErrorMemoryAllocation) {
      static_cast<void>(cudaGetLastError());
      const memory_info info = memory();
      throw out_of_memory(message("cuda:", index_, ": cannot allocate ", bytes_text(bytes), " of device memory; ",
                                  bytes_text(info.free), " free of ", bytes_text(info.total)),
                          bytes, info.free, info.total);
    }
    TASKSWAP_CUDA_TRY(status);
    return static_cast<std::byte*>(p);
  }

  void deallocate(std::byte* p, std::size_t /*bytes*/) noexcept override
  {
    try {
      const cuda_device_guard guard(index_);
      TASKSWAP_ASSERT_CUDA_SUCCESS(cudaFree(p));
    } catch (const cuda_error& e) {
      std::fprintf(stderr, "taskswap: %s\n", e.what());
    }
  }

  // ---- virtual memory: a handle per cuMemCreate, mapped whole (cuMemMap refuses an offset) ----

  [[nodiscard]] std::size_t vm_granularity() const override
  {
    const std::lock_guard lock(vm_mutex_);
    if (granularity_ == 0) {
      const driver_vm& vm = driver_vm::get();
      CUdevice dev = 0;
      int supported = 0;
      TASKSWAP_CU_TRY(vm, vm.device_get(&dev, index_), message("cuda:", index_));
      TASKSWAP_CU_TRY(vm, vm.attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
                      message("cuda:", index_));
      if (supported == 0) {
        throw cuda_error(message("cuda:", index_,
                                 " does not support virtual memory management, which the device pool "
                                 "maps units with (DESIGN invariant 8); use a GPU and driver that do"));
      }
      const CUmemAllocationProp prop = device_memory_on(index_);
      std::size_t g = 0;
      TASKSWAP_CU_TRY(vm, vm.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), message("cuda:", index_));
      granularity_ = std::max<std::size_t>(g, 256);
    }
    return granularity_;
  }

  // A handle is a heap copy of the driver's CUmemGenericAllocationHandle.
  [[nodiscard]] void* vm_create(std::size_t granules) override
  {
    const driver_vm& vm = driver_vm::get();
    const std::size_t g = vm_granularity();
    const cuda_device_guard guard(index_);
    const CUmemAllocationProp prop = device_memory_on(index_);
    CUmemGenericAllocationHandle h{};
    try {
      TASKSWAP_CU_TRY(vm, vm.create(&h, granules * g, &prop, 0),
                      [&] { return message("cuda:", index_, ": a handle of ", granules, " granules"); });
    } catch (const out_of_memory&) {
      const memory_info info = memory();
      throw out_of_memory(
        message("cuda:", index_, ": cannot allocate ", bytes_text(granules * g), " of device memory in one handle; ",
                bytes_text(info.free), " free of ", bytes_text(info.total)),
        granules * g, info.free, info.total);
    }
    return new CUmemGenericAllocationHandle(h);  // NOLINT(cppcoreguidelines-owning-memory): vm_release deletes it
  }

  void vm_release(void* handle, std::size_t granules) override
  {
    const std::unique_ptr<CUmemGenericAllocationHandle> h(static_cast<CUmemGenericAllocationHandle*>(handle));
    const cuda_device_guard guard(index_);
    const driver_vm& vm = driver_vm::get();
    TASKSWAP_CU_TRY(vm, vm.release(*h),
                    [&] { return message("cuda:", index_, ": releasing ", granules, " granules"); });
  }

  [[nodiscard]] std::byte* vm_reserve(std::size_t bytes) override
  {
    const driver_vm& vm = driver_vm::get();
    CUdeviceptr va = 0;
    TASKSWAP_CU_TRY(vm, vm.reserve(&va, bytes, vm_granularity(), 0, 0),
                    message("cuda:", index_, ": reserving ", bytes_text(bytes), " of addresses"));
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast,performance-no-int-to-ptr): a device address
    return reinterpret_cast<std::byte*>(va);
  }

  void vm_free(std::byte* va, std::size_t bytes) noexcept override
  {
    try {
      const driver_vm& vm = driver_vm::get();
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
      TASKSWAP_CU_TRY(vm, vm.free(reinterpret_cast<CUdeviceptr>(va), bytes), "cuMemAddressFree");
    } catch (const error& e) {
      std::fprintf(stderr, "taskswap: %s\n", e.what());
    }
  }

  void vm_map(std::byte* va, void* handle, std::size_t granules) override
  {
    const driver_vm& vm = driver_vm::get();
    const std::size_t bytes = granules * vm_granularity();
    const cuda_device_guard guard(index_);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a device address
    const auto base = reinterpret_cast<CUdeviceptr>(va);
    TASKSWAP_CU_TRY(vm, vm.map(base, bytes, 0, *static_cast<const CUmemGenericAllocationHandle*>(handle), 0),
                    [&] { return message("cuda:", index_, ": mapping ", granules, " granules"); });
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = index_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    try {
      TASKSWAP_CU_TRY(vm, vm.set_access(base, bytes, &access, 1),
                      [&] { return message("cuda:", index_, ": granting access to ", granules, " granules"); });
    } catch (...) {
      static_cast<void>(vm.unmap(base, bytes));
      throw;
    }
  }

  void vm_unmap(std::byte* va, std::size_t granules) override
  {
    const driver_vm& vm = driver_vm::get();
    const cuda_device_guard guard(index_);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): a device address
    const auto base = reinterpret_cast<CUdeviceptr>(va);
    TASKSWAP_CU_TRY(vm, vm.unmap(base, granules * vm_granularity()),
                    [&] { return message("cuda:", index_, ": unmapping ", granules, " granules"); });
  }

  [[nodiscard]] std::byte* allocate_pinned(std::size_t bytes) override
  {
    const cuda_device_guard guard(index_);
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {
      static_cast<void>(cudaGetLastError());
      throw out_of_memory(message("cuda:", index_, ": cannot pin ", bytes_text(bytes),
                                  " of host memory (cudaHostAlloc); lower the request or raise "
                                  "the locked-memory limit (ulimit -l)"),
                          bytes, 0, 0);
    }
    TASKSWAP_CUDA_TRY(status);
    return static_cast<std::byte*>(p);
  }

  void deallocate_pinned(std::byte* p, std::size_t /*bytes*/) noexcept override
  {
    TASKSWAP_ASSERT_CUDA_SUCCESS(cudaFreeHost(p));
  }

  [[nodiscard]] void* create_stream(int priority, bool host_synchronous) override
  {
    TASKSWAP_EXPECTS(!host_synchronous, message("a host-synchronous stream on ", name(),
                                                ": only the emulated device "
                                                "runs a stream's work in the enqueuing thread; make a normal stream"));
    const cuda_device_guard guard(index_);
    cudaStream_t s = nullptr;
    TASKSWAP_CUDA_TRY(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
    return s;
  }

  [[nodiscard]] void* adopt_stream(std::uintptr_t handle) override
  {
    const cuda_device_guard guard(index_);
    // 0 is the legacy default stream (PyTorch's default stream reports 0): its own handle keeps
    // it apart from "no stream" in the runtime's bookkeeping. It and the per-thread default stream
    // mean "the current device's": every operation on them sets this device first (implicit_guard).
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast,performance-no-int-to-ptr): a handle
    cudaStream_t s = handle == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(handle);
#if CUDART_VERSION >= 12080
    int on = -1;
    TASKSWAP_CUDA_TRY(cudaStreamGetDevice(s, &on));
    TASKSWAP_EXPECTS(on == index_, message("external_stream(", handle, "): the stream belongs to cuda:", on,
                                           ", not cuda:", index_, "; wrap it with the device it was made on"));
#else
    // cudaStreamGetDevice came with CUDA 12.8: an older runtime only checks that the handle is a stream.
    const cudaError_t status = cudaStreamQuery(s);
    if (status != cudaErrorNotReady) { TASKSWAP_CUDA_TRY(status); }
#endif
    return s;
  }

  void destroy_stream(void* s) noexcept override
  {
    // Queued work still completes; cudaStreamDestroy returns at once.
    TASKSWAP_ASSERT_CUDA_SUCCESS(cudaStreamDestroy(as_stream(s)));
  }

  void synchronize_stream(void* s) override
  {
    const implicit_stream_guard guard(s, index_);
    TASKSWAP_CUDA_TRY(cudaStreamSynchronize(as_stream(s)));
  }

  [[nodiscard]] bool query_stream(void* s) override
  {
    const implicit_stream_guard guard(s, index_);
    const cudaError_t status = cudaStreamQuery(as_stream(s));
    if (status == cudaErrorNotReady) { return false; }
    TASKSWAP_CUDA_TRY(status);
    return true;
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, copy_direction direction, void* s) override
  {
    const implicit_stream_guard guard(s, index_);
    TASKSWAP_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kind_of(direction), as_stream(s)));
  }

  void fill_async(void* dst, std::byte value, std::size_t bytes, void* s) override
  {
    const implicit_stream_guard guard(s, index_);
    TASKSWAP_CUDA_TRY(cudaMemsetAsync(dst, std::to_integer<int>(value), bytes, as_stream(s)));
  }

  void launch_host_func(void* s, std::function<void()> fn) override
  {
    const implicit_stream_guard guard(s, index_);
    auto payload = std::make_unique<host_func_payload>(host_func_payload{error_slot(s), std::move(fn)});
    TASKSWAP_CUDA_TRY(cudaLaunchHostFunc(as_stream(s), host_func_trampoline, payload.get()));
    static_cast<void>(payload.release());  // the trampoline owns it now
  }

  [[nodiscard]] void* create_event(bool timing) override
  {
    const cuda_device_guard guard(index_);
    cudaEvent_t e = nullptr;
    TASKSWAP_CUDA_TRY(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }

  void destroy_event(void* e) noexcept override { TASKSWAP_ASSERT_CUDA_SUCCESS(cudaEventDestroy(as_event(e))); }

  void record_event(void* e, void* s) override
  {
    const implicit_stream_guard guard(s, index_);
    TASKSWAP_CUDA_TRY(cudaEventRecord(as_event(e), as_stream(s)));
  }

  void wait_event(void* s, void* e) override
  {
    const implicit_stream_guard guard(s, index_);
    TASKSWAP_CUDA_TRY(cudaStreamWaitEvent(as_stream(s), as_event(e), 0));
  }

  void synchronize_event(void* e) override { TASKSWAP_CUDA_TRY(cudaEventSynchronize(as_event(e))); }

  [[nodiscard]] bool synchronize_event_for(void* e, std::chrono::nanoseconds timeout) override
  {
    // CUDA has no timed event wait: poll, backing off from 10 us to 1 ms.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::chrono::microseconds pause{10};
    for (;;) {
      if (query_event(e)) { return true; }
      if (std::chrono::steady_clock::now() >= deadline) { return false; }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds{1000});
    }
  }

  [[nodiscard]] bool query_event(void* e) override
  {
    const cudaError_t status = cudaEventQuery(as_event(e));
    if (status == cudaErrorNotReady) { return false; }
    TASKSWAP_CUDA_TRY(status);
    return true;
  }

  [[nodiscard]] double elapsed_ms(void* start, void* end) override
  {
    float ms = 0.0F;
    TASKSWAP_CUDA_TRY(cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
    return static_cast<double>(ms);
  }

 private:
  int index_;
  mutable std::mutex vm_mutex_;
  mutable std::size_t granularity_ = 0;
  std::string name_;
};

}  // namespace

int cuda_device_count() noexcept
{
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // no driver or no device: not an error here
    return 0;
  }
  return count;
}

std::shared_ptr<backend> cuda_backend_for(int index)
{
  const int count = cuda_device_count();
  if (index < 0 || index >= count) {
    throw cuda_error(message("cuda device ", index, " does not exist: this process sees ", count,
                             " CUDA device(s); pick an index below ", count, " or use the emulated backend"));
  }
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<backend>> backends;
  const std::lock_guard lock(mutex);
  auto& slot = backends[index];
  auto existing = slot.lock();
  if (existing) { return existing; }
  auto created = std::make_shared<cuda_backend>(index);
  slot = created;
  return created;
}

}  // namespace taskswap::detail

namespace taskswap::detail {

namespace {
std::string cuda_version_text(int version) { return message(version / 1000, ".", (version % 1000) / 10); }
}  // namespace

std::string cuda_runtime_version()
{
  int version = 0;
  TASKSWAP_CUDA_TRY(cudaRuntimeGetVersion(&version));
  return cuda_version_text(version);
}

std::string cuda_driver_version()
{
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess || version == 0) {
    static_cast<void>(cudaGetLastError());
    return "none";
  }
  return cuda_version_text(version);
}

}  // namespace taskswap::detail
