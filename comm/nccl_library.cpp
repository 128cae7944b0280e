// SPDX-License-Identifier: Apache-2.0
// NCCL, loaded at run time: Note [NCCL at run time] in comm/nccl_library.hpp.

#include "comm/nccl_library.hpp"

#include "device/message.hpp"

#include <taskswap/error.hpp>

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#ifndef TASKSWAP_NCCL_BUILD_LIBRARY
#define TASKSWAP_NCCL_BUILD_LIBRARY ""
#endif

namespace taskswap::detail {

namespace {

std::mutex load_mutex;
std::string preferred;  // guarded by load_mutex
std::atomic<const nccl_library*> loaded{nullptr};

std::string dl_error()
{
  const char* e = dlerror();
  return e != nullptr ? e : "unknown dlopen error";
}

std::string loaded_path(void* handle, std::string_view fallback)
{
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name != '\0') {
    return map->l_name;
  }
  return std::string(fallback);
}

template <typename F>
bool bind(void* handle, F& slot, const char* symbol, std::string& missing)
{
  void* p = dlsym(handle, symbol);
  if (p == nullptr) {
    missing += missing.empty() ? symbol : std::string(", ") + symbol;
    return false;
  }
  slot = reinterpret_cast<F>(p);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast): dlsym's contract
  return true;
}

// The table of the library at `handle`, or why it cannot serve (missing functions, too old).
std::unique_ptr<nccl_library> table(void* handle, std::string_view name, std::string& why)
{
  auto lib = std::make_unique<nccl_library>();
  lib->path = loaded_path(handle, name);
  std::string missing;
  bool ok = bind(handle, lib->get_version, "ncclGetVersion", missing);
  ok = bind(handle, lib->get_error_string, "ncclGetErrorString", missing) && ok;
  ok = bind(handle, lib->get_last_error, "ncclGetLastError", missing) && ok;
  ok = bind(handle, lib->get_unique_id, "ncclGetUniqueId", missing) && ok;
  ok = bind(handle, lib->comm_init_rank, "ncclCommInitRank", missing) && ok;
  ok = bind(handle, lib->comm_split, "ncclCommSplit", missing) && ok;
  ok = bind(handle, lib->comm_destroy, "ncclCommDestroy", missing) && ok;
  ok = bind(handle, lib->comm_abort, "ncclCommAbort", missing) && ok;
  ok = bind(handle, lib->comm_get_async_error, "ncclCommGetAsyncError", missing) && ok;
  ok = bind(handle, lib->comm_count, "ncclCommCount", missing) && ok;
  ok = bind(handle, lib->comm_user_rank, "ncclCommUserRank", missing) && ok;
  ok = bind(handle, lib->all_reduce, "ncclAllReduce", missing) && ok;
  ok = bind(handle, lib->broadcast, "ncclBroadcast", missing) && ok;
  ok = bind(handle, lib->group_start, "ncclGroupStart", missing) && ok;
  ok = bind(handle, lib->group_end, "ncclGroupEnd", missing) && ok;
  ok = bind(handle, lib->red_op_create_pre_mul_sum, "ncclRedOpCreatePreMulSum", missing) && ok;
  ok = bind(handle, lib->red_op_destroy, "ncclRedOpDestroy", missing) && ok;
  if (!ok) {
    why = message(lib->path, ": lacks ", missing);
    return nullptr;
  }
  if (lib->get_version(&lib->version) != ncclSuccess || lib->version < nccl_minimum_version) {
    why = message(lib->path, ": NCCL ", lib->version_text(), " is older than 2.18, which taskswap needs");
    return nullptr;
  }
  return lib;
}

// Tries one candidate; on success the handle stays open for the life of the process.
std::unique_ptr<nccl_library> try_open(const std::string& name, int flags, std::vector<std::string>& tried)
{
  if (name.empty()) { return nullptr; }
  void* handle = dlopen(name.c_str(), flags);
  if (handle == nullptr) {
    if ((flags & RTLD_NOLOAD) == 0) { tried.push_back(dl_error()); }
    return nullptr;
  }
  std::string why;
  auto lib = table(handle, name, why);
  if (!lib) {
    tried.push_back(why);
    dlclose(handle);
  }
  return lib;
}

}  // namespace

std::string nccl_library::version_text() const
{
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return message(version / 10000, ".", (version % 10000) / 100, ".", version % 100);
}

const nccl_library& nccl()
{
  if (const nccl_library* lib = loaded.load(std::memory_order_acquire)) { return *lib; }
  const std::lock_guard lock(load_mutex);
  if (const nccl_library* lib = loaded.load(std::memory_order_relaxed)) { return *lib; }
  std::vector<std::string> tried;
  std::unique_ptr<nccl_library> lib;
  constexpr int flags = RTLD_NOW | RTLD_LOCAL;
  if (const char* forced = std::getenv("TASKSWAP_NCCL_LIBRARY"); forced != nullptr && *forced != '\0') {
    lib = try_open(forced, flags, tried);
    if (!lib) {
      throw comm_error(message("taskswap: cannot use the NCCL that TASKSWAP_NCCL_LIBRARY names (", tried.front(),
                               "); point it at a libnccl.so.2 of 2.18 or later, or unset it"));
    }
  } else {
    lib = try_open("libnccl.so.2", flags | RTLD_NOLOAD, tried);  // one the process has already
    if (!lib) { lib = try_open(preferred, flags, tried); }
    if (!lib) { lib = try_open(TASKSWAP_NCCL_BUILD_LIBRARY, flags, tried); }
    if (!lib) { lib = try_open("libnccl.so.2", flags, tried); }
  }
  if (!lib) {
    std::string all;
    for (const std::string& t : tried) { all += (all.empty() ? "" : "; ") + t; }
    throw comm_error(message("taskswap: no usable NCCL library (", all,
                             "); install NCCL 2.18 or later (apt, or pip's nvidia-nccl) or set TASKSWAP_NCCL_LIBRARY "
                             "to its libnccl.so.2"));
  }
  const nccl_library* out = lib.release();  // for the life of the process, as the library itself
  loaded.store(out, std::memory_order_release);
  return *out;
}

void prefer_nccl_library(std::string path)
{
  const std::lock_guard lock(load_mutex);
  preferred = std::move(path);
}

bool nccl_loaded() noexcept { return loaded.load(std::memory_order_acquire) != nullptr; }

}  // namespace taskswap::detail
